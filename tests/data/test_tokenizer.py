"""The offline Qwen2 tokenizer equals tiktoken on the same ranks, and has Qwen2's special ids."""

import json
import unicodedata

import tiktoken

from loongforge.data.tokenizer import (
    QWEN2_PRETOKENIZE_REGEX,
    bpe_merges_from_ranks,
    qwen_ranks_path,
    read_tiktoken_ranks,
)
from tests.data.conftest import LLAMAFACTORY, SHARED_DATA, require


def _real_texts() -> list[str]:
    texts = []
    names = ("alpaca_zh_demo.json", "alpaca_en_demo.json", "oaast_sft_zh.json", "glaive_toolcall_en_demo.json")
    for name in names:
        records = json.loads(require(LLAMAFACTORY / name).read_text(encoding="utf-8"))
        texts += [json.dumps(r, ensure_ascii=False) for r in records[:150]]
    texts.append(require(LLAMAFACTORY / "wiki_demo.txt").read_text(encoding="utf-8")[:200_000])
    answers = require(SHARED_DATA / "arena_hard" / "v2.0_model_answer_o3-mini-2025-01-31.jsonl")
    with open(answers, encoding="utf-8") as f:
        texts += [next(f) for _ in range(100)]
    # whitespace runs, digits, CRLF, emoji, combining marks (NFC), mixed scripts
    texts += ["  \n\n\t x\r\n\r\n  y   ", "12345678 3.14159 1e-9", "naïve café 😀👍🏽 ñ",
              "Привет мир こんにちは 안녕하세요 مرحبا"]
    return texts


def test_matches_tiktoken_on_real_multilingual_text(tokenizer):
    encoding = tiktoken.Encoding(
        "qwen2", pat_str=QWEN2_PRETOKENIZE_REGEX, mergeable_ranks=read_tiktoken_ranks(qwen_ranks_path()),
        special_tokens={},
    )
    total = 0
    for text in _real_texts():
        text = unicodedata.normalize("NFC", text)  # Qwen normalises to NFC before BPE
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ours == encoding.encode(text, disallowed_special=()), text[:80]
        total += len(ours)
    assert total > 200_000  # the comparison really covered a lot of text


def test_special_tokens_at_qwen2_ids(tokenizer):
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
                "<|file_sep|>": 151664}
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(tokenizer) == 151665
    ids = tokenizer("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and ids[-1] == 151645
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert tokenizer.pad_token_id == 151643 and tokenizer.eos_token == "<|im_end|>"


def test_merges_follow_rank_order():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert bpe_merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


def test_second_load_reads_the_cache(tokenizer, monkeypatch):
    import loongforge.data.tokenizer as tokenizer_module

    def must_not_build(ranks):
        raise AssertionError("tokenizer rebuilt although a cached tokenizer.json exists")

    monkeypatch.setattr(tokenizer_module, "build_qwen2_backend", must_not_build)
    again = tokenizer_module.load_tokenizer("qwen")  # the session fixture already built + cached it
    assert again("héllo 世界")["input_ids"] == tokenizer("héllo 世界")["input_ids"]
    assert not list(tokenizer_module._cache_dir().glob("*.tmp"))  # atomic write left no temp file
