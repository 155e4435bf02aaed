"""LoRA on Qwen3.5 equals transformers + PEFT: adapters on every decoder linear, Gated DeltaNet's four input
projections (fused into one key-head-grouped ``in_proj``, each PEFT adapter's B rows placed with its
projection's rows) and its output projection included, read from PEFT's tensors through ``lora_rules``, give
PEFT's logits at TP 1, and are written back to PEFT's names unchanged; the adapters' count equals PEFT's."""

from __future__ import annotations

import torch

from loongforge.config.schema import LoraConfig, ParallelConfig
from loongforge.models.hf.weights import megatron_to_hf
from loongforge.models.layers.lora_params import adapter_parameters, lora_rules
from loongforge.models.hf.state_dict_names import is_adapter_key
from tests.models.test_lora import ALPHA, RANK, _lora_model, peft_tensors, with_random_adapters
from tests.models.references import qwen3_5_hf_model as build_hf_model
from tests.models.references import qwen3_5_model_cfg as tiny_model_cfg
from tests.models.test_qwen3_vl_support import hf_position_ids, make_sample, our_inputs
from tests.models.tower_helpers import relative

TOLERANCE = 1e-5  # of the largest logit, as without adapters (test_parity.py, qwen3_5)
TARGETS = (r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_(qkv|z|b|a)|out_proj)"
           r"|mlp\.(gate|up|down)_proj)")


def test_adapters_on_linear_and_full_attention_match_peft(megatron_world_of_one):
    from loongforge.models.qwen3_5.model import build_model

    model_cfg = tiny_model_cfg()
    hf_model = build_hf_model(model_cfg)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    peft_model = with_random_adapters(hf_model, TARGETS)
    peft_state = peft_tensors(peft_model)
    model, counts = _lora_model(build_model, model_cfg, ParallelConfig(), hf_state, peft_state,
                                LoraConfig(rank=RANK, alpha=ALPHA))
    assert counts == {"language.qkv": 4, "language.proj": 4, "language.fc1": 4, "language.fc2": 4}
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    positions = hf_position_ids(peft_model.get_base_model(), sample)
    with torch.no_grad():
        reference = peft_model(input_ids=sample.input_ids, position_ids=positions, pixel_values=sample.pixel_values,
                               image_grid_thw=sample.image_grid_thw).logits
        with peft_model.disable_adapter():
            without = peft_model.get_base_model()(input_ids=sample.input_ids, position_ids=positions,
                                                  pixel_values=sample.pixel_values,
                                                  image_grid_thw=sample.image_grid_thw).logits
        logits = model(**our_inputs(sample, positions))
    error, moved = relative(logits, reference), relative(without, reference)
    print(f"\nLoRA Qwen3.5 logits vs PEFT: {error:.1e} of the largest (the adapters move them {moved:.1e})")
    assert error <= TOLERANCE and moved > 100 * TOLERANCE
    written = megatron_to_hf([{k: v for k, v in model.state_dict().items() if is_adapter_key(k)}], model_cfg,
                             rules=lora_rules(model_cfg))
    assert written.keys() == peft_state.keys()
    assert all(torch.equal(written[key], peft_state[key]) for key in peft_state)
    # in_proj's B rows in PEFT's projection order instead of grouped by key head: visibly wrong.
    in_proj = model.language_model.decoder.layers[0].self_attention.in_proj.lora
    prefix = "model.language_model.layers.0.linear_attn.in_proj_"
    with torch.no_grad():
        in_proj.B.copy_(torch.cat([peft_state[f"{prefix}{p}.lora_B.weight"] for p in ("qkv", "z", "b", "a")]))
        misordered = model(**our_inputs(sample, positions))
    assert relative(misordered, reference) > 100 * TOLERANCE
    adapters = sum(tensor.numel() for tensor in peft_state.values())
    assert adapter_parameters(model_cfg, LoraConfig(rank=RANK, alpha=ALPHA), tensor_parallel=1,
                              vision_tensor_parallel=1, expert_parallel=1).total == adapters
