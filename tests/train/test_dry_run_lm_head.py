"""The dry run's LM head term (``dry_run.lm_head_activation_bytes``): the whole row's logits (an fp32 copy per
head, the multi-token-prediction layers' too, beside the GEMM's bf16 output), or with
``training.loss_chunk_tokens`` one chunk's; the plan's text states what chunking holds against the whole
row, or what the suggested chunk would."""

from __future__ import annotations

import dataclasses

from loongforge.config.layout import derive_parallel_sizes
from loongforge.config.loader import load_run_config
from loongforge.config.schema import SUGGESTED_LOSS_CHUNK_TOKENS
from loongforge.train.context_plan import build_context_plan, format_context_plan
from loongforge.train.dry_run import GIB, lm_head_activation_bytes

PRESET = "qwen2.5vl-7b"  # bf16, seq_len 16384, TP 2


def test_the_head_holds_one_chunk_of_logits():
    whole_cfg = load_run_config(PRESET)
    sizes = derive_parallel_sizes(whole_cfg.parallel)
    tokens, vocabulary = whole_cfg.data.seq_len, whole_cfg.model.language.vocab_size / sizes.tensor_parallel
    assert whole_cfg.training.loss_chunk_tokens == 0 and whole_cfg.training.precision == "bf16"
    assert lm_head_activation_bytes(whole_cfg, sizes) == tokens * vocabulary * (4 + 2)
    chunked_cfg = load_run_config(PRESET, overrides=["training.loss_chunk_tokens=512"])
    assert lm_head_activation_bytes(chunked_cfg, sizes) == 512 * vocabulary * (4 + 2)
    assert lm_head_activation_bytes(chunked_cfg, sizes, whole=True) == lm_head_activation_bytes(whole_cfg, sizes)
    # every multi-token-prediction head keeps its fp32 logits for backward; chunked, none does
    mtp_cfg = dataclasses.replace(chunked_cfg, model=dataclasses.replace(chunked_cfg.model, language=dataclasses.replace(
        chunked_cfg.model.language, mtp_num_layers=2)))
    assert lm_head_activation_bytes(mtp_cfg, sizes, whole=True) == tokens * vocabulary * (3 * 4 + 2)
    assert lm_head_activation_bytes(mtp_cfg, sizes) == lm_head_activation_bytes(chunked_cfg, sizes)

    whole_text = format_context_plan(build_context_plan(whole_cfg))
    chunked_text = format_context_plan(build_context_plan(chunked_cfg))
    whole_gib = lm_head_activation_bytes(whole_cfg, sizes) / GIB
    chunk_gib = lm_head_activation_bytes(chunked_cfg, sizes) / GIB
    print(f"\n{PRESET}: the LM head's logits {whole_gib:.2f} GiB whole, {chunk_gib:.2f} GiB in chunks of 512")
    assert (f"the whole row's logits, {whole_gib:.2f} GiB; training.loss_chunk_tokens={SUGGESTED_LOSS_CHUNK_TOKENS} "
            f"would hold {chunk_gib:.2f} GiB") in whole_text
    assert (f"512 tokens' logits at a time, training.loss_chunk_tokens: {chunk_gib:.2f} GiB where the whole row's "
            f"are {whole_gib:.2f} GiB") in chunked_text
