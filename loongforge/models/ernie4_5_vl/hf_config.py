"""ERNIE-4.5-VL's HF ``config.json`` both ways (transformers' ``Ernie4_5_VLMoeConfig``: a nested ``text_config``
and ``vision_config``), the HF tensor shapes a config implies, and what its models cannot be.

The decoder: GQA without biases, interleaved-pair 3-D RoPE (``rope_parameters.mrope_section``: height, width,
time), a dense first ``mlp_layer_types`` run then sparse layers of modality-isolated experts
(``moe_intermediate_size``: [text experts' width, vision experts' width]) beside ``moe_num_shared_experts``
shared experts of the text experts' width (one ungated MLP of their summed width).
"""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.errors import InputError
from loongforge.config.language_parts import MoEConfig
from loongforge.config.schema import LanguageConfig, ModelConfig, ProjectorConfig, TokenIdsConfig, VisionConfig
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.towers.ernie_vit.hf_mapping import hf_shapes as tower_hf_shapes

NAME = "ernie4_5_vl"
HF_ARCHITECTURES = ("Ernie4_5_VLMoeForConditionalGeneration",)
HF_MODEL_TYPES = ("ernie4_5_vl_moe",)
VISION_ROPE_THETA = 10000.0  # the ViT's 2-D rotary base (``vision_common.rotary_freqs``')
# The video markers (transformers' defaults): loongforge's ERNIE-4.5-VL trains on images, its config.json
# keeps them.
VIDEO_START_TOKEN_ID, VIDEO_END_TOKEN_ID = 101306, 101307


def _dense_layers(layer_types: list[str], where: str) -> int:
    dense = next((i for i, kind in enumerate(layer_types) if kind != "dense"), len(layer_types))
    if any(kind != "sparse" for kind in layer_types[dense:]):
        raise InputError(f"{where}: text_config.mlp_layer_types={layer_types}: loongforge builds a run of dense layers "
                         f"then sparse ones")
    return dense


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    try:
        rope = text.get("rope_parameters") or {}
        layers = text["num_hidden_layers"]
        text_ffn, vision_ffn = text.get("moe_intermediate_size") or [1536, 512]
        shared = text.get("moe_num_shared_experts", 2)
        moe = MoEConfig(num_experts=text.get("moe_num_experts", 64), ffn_hidden_size=text_ffn,
                        router_topk=text.get("moe_k", 6), norm_topk_prob=True, router_fp32=True,
                        shared_expert_ffn_hidden_size=shared * text_ffn if shared else None, shared_expert_gate=False,
                        first_dense_layers=_dense_layers(text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
                                                         where),
                        vision_ffn_hidden_size=vision_ffn,
                        # transformers trains with it only where output_router_logits is on
                        aux_loss_coeff=float(text.get("router_aux_loss_coef", 0.001)) if text.get("output_router_logits") else 0.0)
        merge = vision.get("spatial_merge_size", 2)
        return ModelConfig(
            family=NAME,
            vision=VisionConfig(
                arch="ernie_vit", depth=vision["depth"], hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"], num_heads=vision["num_heads"],
                in_channels=vision.get("in_channels", 3), patch_size=vision.get("patch_size", 14), temporal_patch_size=1,
                window=None, rms_norm_eps=vision.get("rms_norm_eps", 1e-6),
                hidden_act=vision.get("hidden_act", "quick_gelu"), norm="layer"),
            projector=ProjectorConfig(arch="resampler", spatial_merge_size=merge, hidden_act="gelu",
                                      out_hidden_size=text["hidden_size"]),
            language=LanguageConfig(
                num_layers=layers, hidden_size=text["hidden_size"], ffn_hidden_size=text["intermediate_size"],
                num_attention_heads=text["num_attention_heads"],
                num_query_groups=text.get("num_key_value_heads") or text["num_attention_heads"],
                head_dim=text.get("head_dim"), vocab_size=text["vocab_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-5),
                rope_theta=float(rope.get("rope_theta", 500_000.0)), mrope_section=list(rope.get("mrope_section", [22, 22, 20])),
                max_position_embeddings=text.get("max_position_embeddings", 131072),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
                add_qkv_bias=bool(text.get("use_bias", False)), moe=moe),
            tokens=TokenIdsConfig(image_token_id=cfg.get("image_token_id", 100295),
                                  video_token_id=cfg.get("video_token_id", 103367),
                                  vision_start_token_id=cfg.get("image_start_token_id", 101304),
                                  vision_end_token_id=cfg.get("image_end_token_id", 101305),
                                  pad_token_id=text.get("pad_token_id") or cfg.get("pad_token_id") or 0),
        )
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete ERNIE-4.5-VL config.json?") from None


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    vis, lang, proj, tok = model_cfg.vision, model_cfg.language, model_cfg.projector, model_cfg.tokens
    moe = lang.moe
    shared = (moe.shared_expert_ffn_hidden_size or 0) // moe.ffn_hidden_size
    text = {
        "model_type": "ernie4_5_vl_moe_text", "vocab_size": lang.vocab_size, "hidden_size": lang.hidden_size,
        "intermediate_size": lang.ffn_hidden_size, "num_hidden_layers": lang.num_layers,
        "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.num_query_groups,
        "hidden_act": "silu", "max_position_embeddings": lang.max_position_embeddings, "rms_norm_eps": lang.rms_norm_eps,
        "use_bias": lang.add_qkv_bias, "tie_word_embeddings": lang.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": lang.rope_theta,
                            "mrope_section": list(lang.mrope_section)},
        "moe_intermediate_size": [moe.ffn_hidden_size, moe.vision_ffn_hidden_size], "moe_k": moe.router_topk,
        "moe_num_experts": moe.num_experts, "moe_num_shared_experts": shared, "moe_norm_min": 1e-12,
        "mlp_layer_types": ["dense"] * moe.first_dense_layers + ["sparse"] * (lang.num_layers - moe.first_dense_layers),
        "output_router_logits": moe.aux_loss_coeff > 0, "router_aux_loss_coef": moe.aux_loss_coeff or 0.001,
        "pad_token_id": tok.pad_token_id,
    }
    if lang.head_dim is not None:
        text["head_dim"] = lang.head_dim
    return {
        "architectures": [HF_ARCHITECTURES[0]], "model_type": HF_MODEL_TYPES[0], "dtype": dtype,
        "tie_word_embeddings": lang.tie_word_embeddings,
        "image_token_id": tok.image_token_id, "image_start_token_id": tok.vision_start_token_id,
        "image_end_token_id": tok.vision_end_token_id, "video_token_id": tok.video_token_id,
        "video_start_token_id": VIDEO_START_TOKEN_ID, "video_end_token_id": VIDEO_END_TOKEN_ID,
        "text_config": text,
        "vision_config": {
            "model_type": "ernie4_5_vl_moe_vision", "depth": vis.depth, "hidden_size": vis.hidden_size,
            "intermediate_size": vis.intermediate_size, "num_heads": vis.num_heads, "in_channels": vis.in_channels,
            "patch_size": vis.patch_size, "hidden_act": vis.hidden_act, "rms_norm_eps": vis.rms_norm_eps,
            "spatial_merge_size": proj.spatial_merge_size, "temporal_merge_size": 2,
            "rope_parameters": {"rope_type": "axial", "rope_theta": VISION_ROPE_THETA},
        },
    }


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {**tower_hf_shapes(model_cfg), **language_hf_shapes(model_cfg.language)}


def config_problems(model_cfg: ModelConfig) -> list[str]:
    """What an ERNIE-4.5-VL model must be beyond the shared checks (one line each: key, value, fix)."""
    lang, found = model_cfg.language, []
    if lang.moe is None or not lang.moe.vision_ffn_hidden_size:
        found.append("model.language.moe.vision_ffn_hidden_size is not set: ERNIE-4.5-VL's sparse layers hold text and "
                      "vision experts; set it (and the moe section)")
    if lang.add_qkv_bias or lang.qk_norm or lang.mrope_interleaved:
        found.append("model.language.add_qkv_bias / qk_norm / mrope_interleaved: ERNIE-4.5-VL's attention has no biases, "
                     "no q/k norms and rotates interleaved pairs of its own layout; set them false")
    if lang.multi_latent_attention is not None or lang.yarn is not None or lang.layer_types:
        found.append("model.language.multi_latent_attention / yarn / layer_types: ERNIE-4.5-VL's decoder is grouped-query "
                     "attention in every layer; unset them")
    section = lang.mrope_section
    if len(section) != 3 or section[0] != section[1]:
        found.append(f"model.language.mrope_section={section}: ERNIE-4.5-VL alternates height and width over the first "
                     f"two sections; give [h, h, t]")
    return found
