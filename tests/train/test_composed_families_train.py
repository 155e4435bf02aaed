"""InternVL3.5 (InternViT + pixel shuffle + Qwen3) and LLaVA-OneVision (SigLIP + MLP + anyres packing + Qwen2),
both under 1-D RoPE, train through the same command on the demo photos as their processors cut them (InternVL:
up to 4 tiles and a thumbnail of 56 px; LLaVA-OneVision: one image a sample its base square and anyres crops,
packed by its size, two a padded square each): TP 2 x PP 2 (vision TP 2; DP 2 is family-independent:
``conftest.FAMILY_LAYOUTS``) equals one process (losses, grad norms and Adam moments, each kind of the tower's tensors
included, to 1e-5 relative); stored embeddings (``loongforge encode``: InternVL's features per tile token,
LLaVA-OneVision's each image packed with its newline) train like the frozen online encoder, on a JSON
array written on one line whose records show one image alone and beside another (issue 49: keyed by line,
LLaVA-OneVision's 94 features of the lone image were replaced by the 17 of the other record, whose sample
then trained as a missing_embedding reject)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.conftest import write_shared_image_records
from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    FAMILY_LAYOUTS,
    assert_layout_trains_like_one_process,
    assert_stored_embeddings_train_like_the_frozen_encoder,
    layout_runs,
)

REL = 1e-5
DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
# preset -> the tower tensors (name pieces) whose Adam moments must be among those compared
FAMILIES = {
    "internvl3.5-tiny-small-vocab": (".vision_model.cls_token", ".vision_model.pos_embed", ".mlp.layer_scale",
                                     ".projector.", ".self_attention.q_layernorm", ".self_attention.k_layernorm"),
    "llava-onevision-tiny-small-vocab": (".vision_model.pos_embed", ".image_newline", ".projector."),
    "llava-onevision1.5-tiny-small-vocab": (".vision_model.class_embedding", ".vision_model.class_rotary",
                                            ".vision_model.pre_layernorm", ".projector.norm"),
}
# Adam's epsilon at 1e-6 as in tests/train/test_qwen3_vl_train.py (a gradient element zero up to rounding
# then moves by lr times a sign set by the summation order).
# 2 steps (the second after an update), as the other layout proofs (docs/testing.md).
OPTIONS = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024",
           "optimizer.adam_eps=1e-6", "training.train_steps=2", SAVE_AT_END)


# InternVL as its 38B presets lay out InternViT-6B: q/k norms over all heads beside Qwen3's per-head ones, the tower
# whole on each TP rank (vision TP 1), the TP group sharing the tiles (encoder_dp=tp): megatron's TP sum of every q/k
# norm's gradient must leave the tower's alone (it doubled them at TP 2).
LAYOUT_OPTIONS = {"internvl3.5-tiny-small-vocab": (
    "model.vision.qk_norm=true", "model.vision.norm=rms", "model.vision.qkv_bias=false",
    "parallel.vision_tensor_model_parallel_size=1", "parallel.encoder_dp=tp")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request, tmp_path_factory) -> tuple[str, dict[str, Path]]:
    return request.param, layout_runs(tmp_path_factory.mktemp(request.param), request.param, *OPTIONS,
                                      *LAYOUT_OPTIONS.get(request.param, ()), layouts=FAMILY_LAYOUTS)


@pytest.mark.parametrize("layout", ["tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    preset, family_runs = runs
    assert_layout_trains_like_one_process(family_runs, layout, REL, tensors=FAMILIES[preset])


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_stored_embeddings_train_like_the_frozen_encoder(preset, tmp_path):
    one_line_array, _ = write_shared_image_records(tmp_path)
    assert_stored_embeddings_train_like_the_frozen_encoder(tmp_path, preset, one_line_array, "data.seq_len=1024",
                                                           "data.max_pixels=12544")
