"""The offline Qwen2 and Llama 3 tokenizers equal tiktoken on the same ranks, and have their models'
special ids."""

import json
import unicodedata

import tiktoken

from loongforge.data.tokenizer import (
    LLAMA3_PRETOKENIZE_REGEX,
    LLAMA3_SPECIAL_TOKENS,
    QWEN2_PRETOKENIZE_REGEX,
    bpe_merges_from_ranks,
    llama3_ranks_path,
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


def test_llama3_matches_tiktoken_on_real_multilingual_text(llama_tokenizer):
    """Against the llama-models package's own tiktoken encoding of the ranks (its regex, no
    normalising: a decomposed accent stays two characters)."""
    from llama_models.llama3.tokenizer import Tokenizer

    reference = Tokenizer(llama3_ranks_path()).model
    assert reference._pat_str == LLAMA3_PRETOKENIZE_REGEX
    total = 0
    for text in _real_texts() + ["cafe\u0301 vs caf\u00e9", "1234567 89 0.5 2024-07-23"]:
        ours = llama_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ours == reference.encode(text, disallowed_special=()), text[:80]
        total += len(ours)
    assert total > 200_000
    chat = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|python_tag|>x<|eom_id|>"
    assert llama_tokenizer(chat, add_special_tokens=False)["input_ids"] == reference.encode(chat, allowed_special="all")


def test_llama3_special_tokens_at_the_package_ids(llama_tokenizer):
    from llama_models.llama3.tokenizer import Tokenizer

    package = Tokenizer(llama3_ranks_path()).special_tokens
    assert len(package) == len(LLAMA3_SPECIAL_TOKENS) == 256 and len(llama_tokenizer) == 128_256
    # Every named token at the package's id; the package names two of Llama 3.1's reserved slots
    # after later uses (so its reserved tokens are numbered differently from there on).
    reserved = "<|reserved_special_token_"
    for name, token_id in package.items():
        ours = llama_tokenizer.convert_ids_to_tokens(token_id)
        if name.startswith(reserved) or name in ("<|step_id|>", "<|image|>"):
            assert ours.startswith(reserved), (name, ours)
        else:
            assert ours == name
    assert llama_tokenizer.convert_ids_to_tokens([128005, 128011]) == [f"{reserved}2|>", f"{reserved}3|>"]
    expected = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|finetune_right_pad_id|>": 128004,
                "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eom_id|>": 128008,
                "<|eot_id|>": 128009, "<|python_tag|>": 128010, "<|reserved_special_token_247|>": 128255}
    assert {t: llama_tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert (llama_tokenizer.bos_token_id, llama_tokenizer.eos_token_id, llama_tokenizer.pad_token_id) == (
        128000, 128009, 128004)
    # As the Hub tokenizer: <|begin_of_text|> first unless special tokens are left out.
    assert llama_tokenizer("Hello world")["input_ids"] == [128000, 9906, 1917]
    assert llama_tokenizer("Hello world", add_special_tokens=False)["input_ids"] == [9906, 1917]
    ids = llama_tokenizer("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 128006 and ids[-1] == 128009
    assert llama_tokenizer.decode(ids) == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"


def test_second_load_reads_the_cache(tokenizer, llama_tokenizer, monkeypatch):
    import loongforge.data.tokenizer as tokenizer_module

    def must_not_build(spec, ranks):
        raise AssertionError("tokenizer rebuilt although a cached tokenizer.json exists")

    monkeypatch.setattr(tokenizer_module, "build_backend", must_not_build)
    for spec, built in (("qwen", tokenizer), ("llama3", llama_tokenizer)):  # the fixtures built + cached them
        again = tokenizer_module.load_tokenizer(spec)
        assert again("héllo 世界")["input_ids"] == built("héllo 世界")["input_ids"]
    assert not list(tokenizer_module.cache_root().glob("*.tmp"))  # atomic write left no temp file


def test_unknown_tokenizer_names_the_offline_ones_and_what_to_download(tmp_path):
    import pytest

    from loongforge.config.errors import InputError
    from loongforge.data.tokenizer import check_tokenizer, load_tokenizer

    with pytest.raises(InputError, match=r"^data.tokenizer='llama' is no folder: use one of ernie4.5vl \| "
                                         r"ernie4.5vl-small \| internvl3.5 \| internvl3.5-small \| llama3 \| llama3-small \| "
                                         r"llava-onevision \| llava-onevision-small \| qwen \| qwen-small \| qwen3 \| qwen3-small or a local HF "
                                         r"tokenizer folder$"):
        load_tokenizer("llama")
    folder = tmp_path / "Qwen3.5-9B"
    with pytest.raises(InputError, match=rf"^data.tokenizer='{folder}' is no folder: download Qwen/Qwen3.5-9B's "
                                         r"tokenizer files there \(huggingface-cli download Qwen/Qwen3.5-9B "):
        check_tokenizer(str(folder), "Qwen/Qwen3.5-9B")
    folder.mkdir()
    with pytest.raises(InputError, match=r"holds no tokenizer.json: download"):
        check_tokenizer(str(folder), "Qwen/Qwen3.5-9B")
    (folder / "tokenizer.json").write_text("{}")
    check_tokenizer(str(folder), "Qwen/Qwen3.5-9B")
