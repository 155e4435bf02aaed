"""Tiny HF Qwen2.5-VL checkpoints on disk in both key styles, and CLI invocation helpers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from loongforge.config.schema import ModelConfig
from loongforge.models.qwen2_5_vl.hf_mapping import to_hub_style
from tests.models.helpers import build_hf_model


def hub_style_config(model_cfg: ModelConfig) -> dict:
    """An older Hub ``config.json``: flat text fields, ``rope_theta`` + ``rope_scaling``, ``in_chans``."""
    vis, lang, tok = model_cfg.vision, model_cfg.language, model_cfg.tokens
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": lang.hidden_size, "intermediate_size": lang.ffn_hidden_size,
        "num_hidden_layers": lang.num_layers, "num_attention_heads": lang.num_attention_heads,
        "num_key_value_heads": lang.num_query_groups, "vocab_size": lang.vocab_size,
        "rms_norm_eps": lang.rms_norm_eps, "max_position_embeddings": lang.max_position_embeddings,
        "rope_theta": lang.rope_theta, "rope_scaling": {"type": "mrope", "mrope_section": list(lang.mrope_section)},
        "tie_word_embeddings": lang.tie_word_embeddings, "torch_dtype": "float32",
        "image_token_id": tok.image_token_id, "video_token_id": tok.video_token_id,
        "vision_start_token_id": tok.vision_start_token_id, "vision_end_token_id": tok.vision_end_token_id,
        "vision_config": {
            "depth": vis.depth, "hidden_size": vis.hidden_size, "intermediate_size": vis.intermediate_size,
            "num_heads": vis.num_heads, "in_chans": vis.in_channels, "patch_size": vis.patch_size,
            "temporal_patch_size": vis.temporal_patch_size, "window_size": vis.window.size,
            "fullatt_block_indexes": list(vis.window.fullatt_block_indexes), "hidden_act": vis.hidden_act,
            "spatial_merge_size": model_cfg.projector.spatial_merge_size,
            "out_hidden_size": model_cfg.projector.out_hidden_size, "tokens_per_second": 2,
        },
    }


def save_hf_checkpoint(folder: Path, model_cfg: ModelConfig, *, style: str = "new", seed: int = 0):
    """Random tiny model saved as ``style`` "new" (transformers 5 ``save_pretrained``: nested config,
    ``model.language_model.*`` keys, one file) or "hub" (flat config, ``visual.*``/``model.layers.*``
    keys, two shards + index, a tokenizer file). Returns the transformers model."""
    hf_model = build_hf_model(model_cfg, seed=seed)
    folder = Path(folder)
    if style == "new":
        hf_model.save_pretrained(folder)
        return hf_model
    folder.mkdir(parents=True)
    state = {k: v.detach().clone().contiguous() for k, v in to_hub_style(hf_model.state_dict()).items()}
    if model_cfg.language.tie_word_embeddings:
        state.pop("lm_head.weight")
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(folder / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in halves.items() for k in part}
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hub_style_config(model_cfg)))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32768}))
    return hf_model


def hub_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder, Hub-style names."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return to_hub_style(state)


def invoke(*args: str):
    from loongforge.cli.app import app

    return CliRunner().invoke(app, ["convert", *args, "--no-progress"])


def one_line_error(result) -> str:
    lines = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]
