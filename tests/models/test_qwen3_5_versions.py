"""Qwen3.6 and Qwen3.8 on the Qwen3.5 family (one architecture, templates of their own): the published
config.json of each size, written here as the Hub ships it (facts; never fetched), reads as its preset's
model; the tiny presets keep the published structure (layer pattern, head ratios, untied embeddings, the
experts beside a shared expert of their width) and equal transformers; the Qwen3.8 tiny preset is the Qwen3.6
one's model (its template is its own: ``test_qwen3_5_chat.py``). Counts, shapes and dry runs: the concern
modules that walk every preset (``test_counts.py``, ``tests/cli/test_train.py``)."""

from __future__ import annotations

import time

import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.config.schema import ParallelConfig
from loongforge.convert.families import config_differences
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.qwen3_5.hf_mapping import to_hub_style
from loongforge.models.registry import get_family
from tests.models import test_qwen3_vl_support as qwen3_vl
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.references import (QWEN3_VL_LAYOUTS, _build_qwen3_5, _vlm_sample, qwen3_5_hf_model,
                                     reference_logits)

FAMILY = get_family("qwen3_5")
SAMPLE = _vlm_sample(qwen3_vl)  # (model_cfg, hf_model, *, seed, text_len, **layout) -> Case, ours and theirs
_PERIOD = ["linear_attention"] * 3 + ["full_attention"]
_VISION = {  # the 27-block ViT every published size has (its merger's width is the decoder's)
    "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
    "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "num_heads": 16,
    "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
_ROPE = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
         "rope_theta": 10000000, "rope_type": "default"}
_TOKENS = {"image_token_id": 248056, "video_token_id": 248057, "vision_end_token_id": 248054,
           "vision_start_token_id": 248053}

# Qwen/Qwen3.6-27B's config.json; Qwen/Qwen3.8-27B's is the same but for transformers_version ("5.8.0.dev0").
QWEN3_6_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", **_TOKENS,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": _PERIOD * 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mlp_only_layers": [],
        "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4, "pad_token_id": None,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_parameters": _ROPE,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
    },
    "tie_word_embeddings": False, "transformers_version": "4.57.1",
    "vision_config": {**_VISION, "model_type": "qwen3_5", "out_hidden_size": 5120},
}
QWEN3_8_27B = {**QWEN3_6_27B, "transformers_version": "5.8.0.dev0"}
# Qwen/Qwen3.6-35B-A3B's config.json: no intermediate_size (every layer is sparse).
QWEN3_6_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", **_TOKENS,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "layer_types": _PERIOD * 10,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
        "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "output_router_logits": False, "pad_token_id": None, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_parameters": _ROPE, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
    },
    "tie_word_embeddings": False, "transformers_version": "4.57.1",
    "vision_config": {**_VISION, "model_type": "qwen3_5_moe", "out_hidden_size": 2048},
}
# preset -> (the published config.json, its tiny preset, the template the preset names)
PUBLISHED = {
    "qwen3.6-27b": (QWEN3_6_27B, "qwen3.6-tiny", "qwen3.6"),
    "qwen3.6-35b-a3b": (QWEN3_6_35B_A3B, "qwen3.6-moe-tiny", "qwen3.6"),
    "qwen3.8-27b": (QWEN3_8_27B, "qwen3.8-tiny", "qwen3.8"),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_the_published_config_reads_as_the_presets_model(preset):
    published, _, template = PUBLISHED[preset]
    model_cfg = load_run_config(preset).model
    read = FAMILY.config_from_hf(published, f"{preset}/config.json")
    assert config_differences(model_cfg, read) == []
    assert {name: getattr(read.tokens, name) for name in _TOKENS} == _TOKENS == {
        name: getattr(model_cfg.tokens, name) for name in _TOKENS}
    assert model_cfg.chat_format == template


def _structure(model_cfg) -> dict:
    """What a tiny preset keeps of its published size: the layer pattern, the head ratios, tied or not, and
    the experts' and shared expert's widths against each other (and the dense width, where none is its own)."""
    lang, linear = model_cfg.language, model_cfg.language.linear_attention
    period = lang.layer_types.index("full_attention") + 1
    structure = dict(
        pattern=lang.layer_types == lang.layer_types[:period] * (lang.num_layers // period),
        period=period, query_heads_per_kv_head=lang.num_attention_heads // lang.num_query_groups,
        value_heads_per_key_head=linear.num_value_heads // linear.num_key_heads,
        head_dim_over_linear=lang.head_dim // linear.key_head_dim,
        key_equals_value_dim=linear.key_head_dim == linear.value_head_dim, tied=lang.tie_word_embeddings,
        gate=lang.attention_output_gate, zero_centred=lang.zero_centered_norms,
        partial_rotary=lang.partial_rotary_factor, deepstack=model_cfg.vision.deepstack_layers,
        experts=lang.moe is not None)
    if lang.moe is not None:
        structure.update(shared_width=lang.moe.shared_expert_ffn_hidden_size == lang.moe.ffn_hidden_size,
                         dense_width_is_the_experts=lang.ffn_hidden_size == lang.moe.ffn_hidden_size,
                         renormalised=lang.moe.norm_topk_prob,
                         width_over_experts=lang.hidden_size // lang.moe.ffn_hidden_size)
    return structure


@pytest.mark.parametrize("preset", PUBLISHED)
def test_the_tiny_preset_keeps_the_published_structure(preset):
    published, tiny, template = PUBLISHED[preset]
    tiny_cfg = load_run_config(tiny).model
    assert _structure(tiny_cfg) == _structure(FAMILY.config_from_hf(published, "config.json"))
    assert tiny_cfg.chat_format == template
    assert load_run_config("qwen3.8-tiny").model.language == load_run_config("qwen3.6-tiny").model.language


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


@pytest.mark.parametrize("tiny", ["qwen3.6-tiny", "qwen3.6-moe-tiny"])
def test_the_tiny_preset_equals_transformers(world, tiny):
    """Logits on two images (and on text) equal transformers' Qwen3.5 class of the config.json the family writes,
    every parameter random; the untied head is written back under the Hub's name with every other tensor."""
    start = time.perf_counter()
    model_cfg = load_run_config(tiny).model
    model_cfg.layer_backend = "sdpa"
    hf_model = qwen3_5_hf_model(model_cfg)
    model = _build_qwen3_5(model_cfg, ParallelConfig()).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    worst = 0.0
    for layout in ("text", "two_images"):
        case = SAMPLE(model_cfg, hf_model, seed=0, text_len=12, **QWEN3_VL_LAYOUTS[layout])
        with torch.no_grad():
            expected = reference_logits(hf_model, case)
            logits = model(**case.ours)[..., : expected.shape[-1]]
        worst = max(worst, float((logits - expected).abs().max()) / float(expected.abs().max()))
    written = megatron_to_hf([model.state_dict()], model_cfg)
    expected_state = to_hub_style(hf_model.state_dict())
    assert "lm_head.weight" in written and written.keys() == expected_state.keys()
    assert all(torch.equal(written[key], expected_state[key]) for key in expected_state)
    print(f"\n{tiny}: logits {worst:.1e} of the largest (asserted 1.2e-5), {time.perf_counter() - start:.1f} s")
    assert worst < 1.2e-5
