"""LoRA on DeepSeek-V3 and V2 equals transformers + PEFT: adapters on multi-latent attention's projections
(the latent down-projections, the up-projections after their norms, the query's one projection in V2, the
output), read from PEFT's tensors, give PEFT's logits at
TP 1, and are written back to PEFT's names unchanged."""

from __future__ import annotations

import pytest
import torch

from loongforge.config.schema import LoraConfig, ParallelConfig
from loongforge.models.hf.weights import megatron_to_hf
from loongforge.models.llm.model import build_model
from loongforge.models.layers.lora_params import adapter_parameters, lora_rules
from loongforge.models.hf.state_dict_names import is_adapter_key
from tests.models.llm_helpers import DEEPSEEK_ARCHITECTURES, build_hf_llm, text_positions, tiny_llm_cfg
from tests.models.test_lora import ALPHA, RANK, _lora_model, peft_tensors, with_random_adapters

TOLERANCE = 1e-5
# Attention's projections only: PEFT 0.21 rewrites DeepSeek's MLP targets for transformers 5's fused experts.
TARGETS = r".*layers\.\d+\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"


@pytest.mark.parametrize("arch", list(DEEPSEEK_ARCHITECTURES))
def test_adapters_on_latent_attention_match_peft(arch, megatron_world_of_one):
    model_cfg, hf_model = tiny_llm_cfg(arch), build_hf_llm(arch)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    peft_model = with_random_adapters(hf_model, TARGETS)
    peft_state = peft_tensors(peft_model)
    model, counts = _lora_model(build_model, model_cfg, ParallelConfig(), hf_state, peft_state,
                                LoraConfig(rank=RANK, alpha=ALPHA, modules=["qkv", "proj"]))
    projections = 4 if arch == "deepseek_v3" else 3  # per layer: q_a and q_b (V2: q), kv_a, kv_b
    assert counts == {"language.qkv": 3 * projections, "language.proj": 3}, counts
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = peft_model(input_ids=input_ids).logits
        with peft_model.disable_adapter():
            without = peft_model.get_base_model()(input_ids=input_ids).logits
        logits = model(input_ids=input_ids, position_ids=text_positions(40))[..., :model_cfg.language.vocab_size]
    error, moved = (logits - reference).abs().max().item(), (reference - without).abs().max().item()
    print(f"\n{arch}: LoRA logits vs PEFT {error:.2e} (the adapters move them {moved:.2e})")
    assert error <= TOLERANCE and moved > 1000 * TOLERANCE
    written = megatron_to_hf([{k: v for k, v in model.state_dict().items() if is_adapter_key(k)}], model_cfg,
                             rules=lora_rules(model_cfg))
    assert written.keys() == peft_state.keys()
    assert all(torch.equal(written[key], peft_state[key]) for key in peft_state)
    # The dry run's count of the adapters (lora_params) is PEFT's.
    planned = adapter_parameters(model_cfg, LoraConfig(rank=RANK, alpha=ALPHA, modules=["qkv", "proj"]),
                                 tensor_parallel=1, vision_tensor_parallel=1, expert_parallel=1)
    assert planned.total == sum(tensor.numel() for tensor in peft_state.values())
