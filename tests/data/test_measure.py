"""SampleMeasurer's start-up check: tokenizer, model.tokens and chat format agree. A text-only model
needs no vision tokens, only its pad id (the tokenizer's pad token) and one token per turn marker."""

import dataclasses

import pytest

from loongforge.config.loader import load_run_config
from loongforge.config.schema import DataConfig, TokenIdsConfig
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn

LLAMA = load_run_config("llama-tiny").model
QWEN3 = load_run_config("llm-tiny").model


def _measurer(tokenizer, model_cfg, spec):
    return SampleMeasurer(tokenizer, DataConfig(seq_len=4096, tokenizer=spec), model_cfg)


def test_llama_text_model_needs_only_its_pad_token(llama_tokenizer):
    assert llama_tokenizer.convert_tokens_to_ids("<|image_pad|>") is None  # no Qwen vision tokens
    assert LLAMA.tokens.pad_token_id == llama_tokenizer.convert_tokens_to_ids("<|finetune_right_pad_id|>") == 128004
    measured = _measurer(llama_tokenizer, LLAMA, "llama3").measure(
        ConversationSample("t:1", "t", 1, [Turn("user", "Hi"), Turn("assistant", "Hello!")]))
    assert measured.input_ids[0] == 128000 and measured.input_ids[-1] == 128009


def test_pad_id_must_be_the_tokenizers_pad_token(llama_tokenizer):
    wrong = dataclasses.replace(LLAMA, tokens=TokenIdsConfig(pad_token_id=128001))
    with pytest.raises(ValueError, match=r"model.tokens.pad_token_id=128001 but the tokenizer's pad token "
                                         r"<\|finetune_right_pad_id\|> is 128004"):
        _measurer(llama_tokenizer, wrong, "llama3")
    with pytest.raises(ValueError, match=r"model.tokens.pad_token_id=151643 but"):  # Qwen3 model, Llama tokenizer
        _measurer(llama_tokenizer, QWEN3, "llama3")


def test_chat_markers_must_be_single_tokens(tokenizer, qwen3_tokenizer):
    # A Llama model with Qwen's tokenizer (and Qwen's pad id): Llama's markers would be plain text.
    llama_on_qwen = dataclasses.replace(LLAMA, tokens=TokenIdsConfig())
    with pytest.raises(ValueError, match=r"data.tokenizer=qwen splits <\|begin_of_text\|>, a marker of "
                                         r"the model's chat format, into \d+ tokens"):
        _measurer(tokenizer, llama_on_qwen, "qwen")
    _measurer(qwen3_tokenizer, QWEN3, "qwen3")  # ChatML's markers and Qwen3's think tags are tokens
