"""The LoRA concern, over every reference of ``references.REFERENCES``: the language model's adapters, every A
and B random, read from PEFT's tensors through ``lora_rules``, give transformers + PEFT's logits at fp32 on
the reference's first media layout (an image where it takes media); the adapters move the logits far beyond
the tolerance; they are written back to PEFT's tensors bit for bit (under the Hub's names); and the dry run's adapter count
(``lora_params``) is PEFT's. A family gets it by registering its reference.

Each reference's PEFT targets are the decoder's linears under transformers' names: attention (GQA's q, k, v,
o; multi-latent attention's projections; Gated DeltaNet's four input projections and its output) and the
dense MLP's gate, up and down. Routed experts are fused tensors in transformers 5 that PEFT has no modules
for, so a mixture of experts adapts its attention (``qkv``, ``proj``); their adapters are proven against
their merged weights (``test_lora.py::test_expert_adapters_equal_their_merged_weights``).
"""

from __future__ import annotations

import pytest
import torch

from loongforge.config.schema import LoraConfig, ParallelConfig
from loongforge.models.hf.state_dict_names import is_adapter_key
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.layers.lora import apply_lora
from loongforge.models.layers.lora_params import adapter_parameters, lora_rules
from loongforge.models.registry import get_family
from tests.models.references import REFERENCES, reference_logits
from tests.models.test_lora import ALPHA, RANK, peft_tensors, with_random_adapters

# The decoder's linears under transformers' names (an LLM's ``model.layers``, a VLM's
# ``model.language_model.layers``; a vision tower's blocks never match).
_ATTENTION = (r"self_attn\.(q|k|v|o|q_a|q_b|kv_b)_proj|self_attn\.kv_a_proj_with_mqa"
              r"|linear_attn\.(in_proj_(qkvz|qkv|z|ba|b|a)|out_proj)")
_DENSE_MLP = r"mlp\.(gate|up|down)_proj"
_LAYERS = r"(.*\.)?(language_model|model)\.layers\.\d+\."


def _targets(with_mlp: bool) -> str:
    return f"{_LAYERS}({_ATTENTION}{'|' + _DENSE_MLP if with_mlp else ''})"


def _lora_config(model_cfg) -> LoraConfig:
    if model_cfg.language.moe:
        return LoraConfig(rank=RANK, alpha=ALPHA, modules=["qkv", "proj"])
    return LoraConfig(rank=RANK, alpha=ALPHA)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_language_adapters_equal_peft(name, megatron_world_of_one):
    reference = REFERENCES[name]
    model_cfg = reference.model_cfg()
    hf_model = reference.hf_model(model_cfg)
    layout = "one_image" if "one_image" in reference.layouts else "text"
    case = reference.sample(model_cfg, hf_model, **reference.layouts[layout])
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    lora_cfg = _lora_config(model_cfg)
    peft_model = with_random_adapters(hf_model, _targets(with_mlp=model_cfg.language.moe is None))
    peft_state = peft_tensors(peft_model)
    model = reference.build(model_cfg, ParallelConfig()).eval()
    load_hf_state_dict(model, hf_state)
    counts = apply_lora(model, model_cfg, lora_cfg, seed=0)
    load_hf_state_dict(model, peft_state, rules=lora_rules(model_cfg))
    vocab = model_cfg.language.vocab_size
    with torch.no_grad():
        expected = reference_logits(peft_model, case)  # [1, s, V]
        with peft_model.disable_adapter():
            without = reference_logits(peft_model, case)
        logits = model(**case.ours)[..., :vocab]
    error, moved = reference.difference(logits, expected), reference.difference(without, expected)
    print(f"\n{name} ({layout}): LoRA logits vs PEFT {error:.1e} (the adapters move them {moved:.1e}); {counts}")
    assert error <= reference.tolerance and moved > 100 * reference.tolerance
    # Written under the Hub's names (``convert --adapter`` renames them to the instantiated modules').
    written = megatron_to_hf([{k: v for k, v in model.state_dict().items() if is_adapter_key(k)}], model_cfg,
                             rules=lora_rules(model_cfg))
    hub_state = get_family(model_cfg.family).to_hub_style(peft_state)
    assert written.keys() == hub_state.keys()
    assert all(torch.equal(written[key], hub_state[key]) for key in hub_state)
    planned = adapter_parameters(model_cfg, lora_cfg, tensor_parallel=1, vision_tensor_parallel=1, expert_parallel=1)
    assert planned.total == sum(tensor.numel() for tensor in peft_state.values())
