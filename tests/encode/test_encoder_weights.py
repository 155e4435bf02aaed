"""The encoder ``loongforge encode`` runs, with weights from an HF folder or from a loongforge
checkpoint: the same tensors either way, and the same features as transformers' vision tower."""

from __future__ import annotations

import torch

from loongforge.convert.engine import hf_to_mcore
from loongforge.convert.model_io import load_encoder_weights
from loongforge.models.vlm.fingerprint import weights_digest
from loongforge.models.registry import get_family
from tests.convert.helpers import save_hf_checkpoint
from tests.models.helpers import destroy_megatron, free_port, init_megatron, make_sample, tiny_model_cfg

TOLERANCE = 1e-5  # fp32, relative to the largest feature: the parity tests' bound


def test_hf_and_checkpoint_weights_give_one_encoder_equal_to_transformers(tmp_path):
    model_cfg = tiny_model_cfg(tie=False)
    hf_model = save_hf_checkpoint(tmp_path / "hf", model_cfg, style="hub")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    sample = make_sample(model_cfg, images=((1, 8, 12),), videos=((2, 4, 4),), seed=3)
    pixels = torch.cat([sample.pixel_values, sample.pixel_values_videos])  # [P, C*T*p*p]
    grid = torch.cat([sample.image_grid_thw, sample.video_grid_thw])  # [2, 3]
    init_megatron(0, 1, free_port())
    try:
        build = get_family(model_cfg.family).build_encoder
        encoders = {}
        for source in ("hf", "mcore"):
            encoder = build(model_cfg, params_dtype=torch.float32, device="cpu", init_seed=1)
            assert load_encoder_weights(encoder, model_cfg, tmp_path / source) == len(
                [k for k in encoder.state_dict() if not k.endswith("_extra_state")])
            encoders[source] = encoder.eval()
        assert weights_digest(encoders["hf"]) == weights_digest(encoders["mcore"])
        untouched = build(model_cfg, params_dtype=torch.float32, device="cpu", init_seed=1)
        assert weights_digest(untouched) != weights_digest(encoders["hf"])
        with torch.no_grad():
            ours = encoders["hf"](pixels, grid)  # [P / 4, out_hidden]
            reference = hf_model.model.visual(pixels, grid_thw=grid).pooler_output
        assert ours.shape == reference.shape
        assert float((ours - reference).abs().max() / reference.abs().max()) <= TOLERANCE
    finally:
        destroy_megatron()
