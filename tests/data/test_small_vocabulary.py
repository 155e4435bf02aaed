"""The small test vocabularies (``qwen-small``, ``qwen3-small``, ``llama3-small``: a BPE cut to its first
4,096 ranks) are real BPEs: the demo conversations' text comes back from encode + decode, and each
``*-small-vocab`` preset renders a conversation into the same token structure as its full-vocabulary
preset (the same special tokens in the same order, the same text between them, the same answer
characters under the loss)."""

import json
import unicodedata

import pytest

from loongforge.config.loader import load_run_config
from loongforge.data.conversations import read_record
from loongforge.data.samples import ConversationSample
from loongforge.data.template import render_chat, tokenize_chat
from loongforge.data.tokenizer import SMALL_VOCAB_RANKS, load_tokenizer
from loongforge.models.registry import get_family
from tests.data.conftest import LLAMAFACTORY, require

# LLaMA-Factory's conversation demos (the alpaca ones are instruction records, not conversations).
DEMOS = ("mllm_demo.json", "mllm_video_demo.json", "glaive_toolcall_en_demo.json", "v1_multimodal_demo.jsonl",
         "reason_tool_use_demo_50.jsonl")
# (full preset, small-vocabulary preset)
PRESET_PAIRS = [("qwen2.5vl-tiny", "qwen2.5vl-tiny-small-vocab"), ("llm-tiny", "llm-tiny-small-vocab"),
                ("llama-tiny", "llama-tiny-small-vocab")]


def _demo_conversations(per_file: int = 200) -> list:
    """ConversationSamples of the LLaMA-Factory demos (their first records each; text only matters)."""
    samples = []
    for name in DEMOS:
        path = require(LLAMAFACTORY / name)
        text = path.read_text(encoding="utf-8")
        records = [json.loads(line) for line in text.splitlines() if line.strip()] if name.endswith(".jsonl") else json.loads(text)
        for line, record in enumerate(records[:per_file], start=1):
            sample = read_record(record, None, file=str(path), line=line, ordinal=line - 1, media_root=path.parent)
            if isinstance(sample, ConversationSample):
                samples.append(sample)
    return samples


def _preset_tokenizer(preset: str):
    cfg = load_run_config(preset)
    chat = get_family(cfg.model.family).chat(cfg.model)
    return load_tokenizer(cfg.data.tokenizer, chat.jinja_template), chat, cfg


@pytest.mark.parametrize("spec", ["qwen-small", "qwen3-small", "llama3-small"])
def test_small_vocabulary_round_trips_the_demo_text(spec):
    small, full = load_tokenizer(spec), load_tokenizer(spec.removesuffix("-small"))
    texts = [turn.text for sample in _demo_conversations() for turn in sample.turns]
    small_tokens = full_tokens = 0
    for text in texts:
        if spec != "llama3-small":
            text = unicodedata.normalize("NFC", text)  # Qwen normalises to NFC before BPE
        ids = small(text, add_special_tokens=False)["input_ids"]
        assert small.decode(ids) == text, text[:80]
        assert max(ids) < SMALL_VOCAB_RANKS  # plain text never lands on a special token
        small_tokens += len(ids)
        full_tokens += len(full(text, add_special_tokens=False)["input_ids"])
    print(f"{spec}: {len(texts)} demo turns, {small_tokens} tokens vs {full_tokens} with the full "
          f"vocabulary ({small_tokens / full_tokens:.2f}x), vocabulary {len(small)} vs {len(full)} ids")
    assert small_tokens > 30_000  # the comparison covered a lot of text
    # 4,096 ranks keep common words whole: measured 1.52-1.54x the full vocabulary's tokens.
    assert small_tokens < 2.0 * full_tokens


def _structure(tokenizer, ids, is_answer) -> tuple[list[str], str]:
    """The token sequence as special tokens and the text runs between them, and the answer text."""
    specials = set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids(t)
                                                 for t in tokenizer.get_added_vocab()}
    pieces, run = [], []
    for token_id in ids.tolist():
        if token_id in specials:
            pieces += [tokenizer.decode(run)] if run else []
            pieces.append(tokenizer.convert_ids_to_tokens(token_id))
            run = []
        else:
            run.append(token_id)
    pieces += [tokenizer.decode(run)] if run else []
    return pieces, tokenizer.decode(ids[is_answer].tolist())


@pytest.mark.parametrize("full_preset,small_preset", PRESET_PAIRS)
def test_small_vocab_preset_renders_the_same_token_structure(full_preset, small_preset):
    full_tok, full_chat, full_cfg = _preset_tokenizer(full_preset)
    small_tok, small_chat, small_cfg = _preset_tokenizer(small_preset)
    assert small_chat == full_chat and small_cfg.model.language.vocab_size >= len(small_tok)
    conversations = 0
    for sample in _demo_conversations(per_file=40):
        if sample.images and small_cfg.model.vision is None:
            continue
        rendered = render_chat(sample.turns, None, full_chat)
        full, small = tokenize_chat(full_tok, rendered), tokenize_chat(small_tok, rendered)
        assert small_tok.decode(small.input_ids.tolist()) == rendered.text
        assert _structure(small_tok, small.input_ids, small.is_answer) == \
            _structure(full_tok, full.input_ids, full.is_answer)
        conversations += 1
    print(f"{small_preset}: {conversations} conversations, same specials, text runs and answers as {full_preset}")
    assert conversations >= 20  # 22 for the text-only models, 50 with images
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if small_cfg.model.vision is not None:
            token = full_tok.convert_ids_to_tokens(getattr(full_cfg.model.tokens, key))
            assert small_tok.convert_tokens_to_ids(token) == getattr(small_cfg.model.tokens, key), key
    assert small_tok.convert_ids_to_tokens(small_cfg.model.tokens.pad_token_id) == \
        full_tok.convert_ids_to_tokens(full_cfg.model.tokens.pad_token_id)


def test_a_tokenizer_larger_than_the_vocabulary_is_one_clear_error():
    from loongforge.data.measure import check_token_ids

    cfg = load_run_config("qwen2.5vl-tiny", overrides=["model.language.vocab_size=4224"])
    tokenizer, chat, _ = _preset_tokenizer("qwen2.5vl-tiny")
    with pytest.raises(ValueError, match=r"data.tokenizer=qwen writes ids up to 151664 but model.language.vocab_size=4224"):
        check_token_ids(tokenizer, cfg.data, cfg.model, chat)
