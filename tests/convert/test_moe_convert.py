"""Qwen3-MoE through ``loongforge convert``: the HF folder transformers 5 saves (one tensor per expert
and projection) -> a megatron checkpoint (experts stacked on (layer, expert) axes, as megatron-core's
``SequentialMLP`` shards them) -> HF again, bit-exact; the megatron checkpoint loads into the model,
which then gives transformers' logits (through ``--check-logits`` too: test_check_logits[qwen3_moe]), with
grouped-GEMM experts here (``model.language.moe.experts=grouped``: the same checkpoint names as SequentialMLP's,
which ``--check-logits`` builds on the CPU); a grouped run's checkpoint back to HF bit-exact:
tests/train/test_moe_ep_train.py."""

from __future__ import annotations

import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.convert.engine import hf_to_mcore, mcore_to_hf
from tests.convert.helpers import invoke
from tests.models.llm_helpers import build_hf_llm, text_positions, tiny_llm_cfg
from tests.models.test_grouped_experts import with_experts

ARCH = "qwen3_moe"
# 2 layers x 4 experts x 3 projections, 2 x (q, k, v, o, q_norm, k_norm, 2 norms, router), the
# embedding, the final norm, lm_head.
HUB_TENSORS = 24 + 18 + 3


def _save(path):
    model = build_hf_llm(ARCH)
    model.save_pretrained(path)
    return model


# At TP 2 / PP 2: test_family_roundtrips[qwen3_moe] (the same folder); --check-logits:
# test_check_logits::test_every_reference_agrees_with_transformers[qwen3_moe].
@pytest.mark.parametrize("tp, pp", [(1, 1)])
def test_hf_to_mcore_to_hf_is_exact(tmp_path, tp, pp):
    _save(tmp_path / "hf")
    result = invoke(str(tmp_path / "hf"), "--roundtrip", "--tp", str(tp), "--pp", str(pp))
    assert result.exit_code == 0, result.output
    verdict = result.output.strip().splitlines()[-1]
    assert verdict.startswith(f"round trip HF -> mcore (tp={tp}, pp={pp}")
    assert verdict.endswith(f"{HUB_TENSORS} exact, 0 close, 0 different, 0 missing, 0 unexpected: EXACT"), verdict


def test_converted_checkpoint_loads_into_the_model_and_back(megatron_world_of_one, tmp_path):
    from transformers import AutoModelForCausalLM

    from loongforge.models.llm.model import build_model
    from loongforge.train.checkpoint import load_checkpoint

    hf_model = _save(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    model = build_model(with_experts(tiny_llm_cfg(ARCH), "grouped"), ParallelConfig(), params_dtype=torch.float32,
                        pre_process=True, post_process=True, device="cpu").eval()
    assert "experts: grouped" in model.layer_backends["language"]
    load_checkpoint(tmp_path / "mcore", [model], optimizer=None, scheduler=None)
    input_ids = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=text_positions(32))[..., :300]
        assert (logits - hf_model(input_ids=input_ids).logits).abs().max() <= 1e-5

    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).state_dict()
    for key, tensor in hf_model.state_dict().items():
        assert torch.equal(reloaded[key], tensor), key
