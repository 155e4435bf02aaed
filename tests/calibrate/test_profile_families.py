"""`loongforge profile --sweep` and `fit-cost` on the other families: a text-only LLM (dense, and
Qwen3-MoE) profiles text rows and fits no vision term; Qwen3-VL's designed images are cut into its own 16-pixel patches.
(Qwen2.5-VL's records, over two ranks, are test_profile_run.py's.) Two decoder layers: Qwen3-VL's
DeepStack adds features after both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongforge.balance.cost_model import CostModel
from loongforge.calibrate.fit_cost import run_fit_cost
from loongforge.calibrate.sweep import image_grids
from loongforge.config.loader import load_run_config
from tests.forked_cli import run_cli
from tests.train.conftest import RUN_TIMEOUT_S

SMALL = ("model.language.num_layers=2", "data.seq_len=512", "training.global_batch_size=4",
         "logging.progress_bar=false", "logging.tensorboard=false")
VISION_TERMS = ("sum_P2", "sum_P", "n_img")


def _profile(preset: str, output: Path, steps: int) -> list[dict]:
    proc = run_cli(["profile", "--preset", preset, "--sweep", "--steps", str(steps), "--warmup-steps", "1",
                    "--output", str(output), *SMALL], timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in output.read_text().splitlines()]


def _fit(profile: Path, output: Path) -> CostModel:
    return run_fit_cost([profile], output=output, echo=lambda line: None, warn=lambda line: None)


@pytest.mark.parametrize("preset", ["llm-tiny-small-vocab", "qwen3-moe-tiny-small-vocab", "deepseek-v3-tiny-small-vocab"])
def test_a_text_only_llm_profiles_text_rows_and_fits_no_vision_term(tmp_path, preset):
    records = _profile(preset, tmp_path / "PROFILE.jsonl", steps=4)
    assert records[0]["preset"] == preset
    micro_batches = [r for r in records if r["kind"] == "micro_batch"]
    assert len(micro_batches) == 4 * 4  # 4 steps of 4 one-row micro-batches
    for record in micro_batches:
        assert all(record["features"][term] == 0 for term in VISION_TERMS), record["features"]
        assert record["features"]["sum_L"] > 0 and all(s["patches"] == [] for s in record["samples"])
    model = _fit(tmp_path / "PROFILE.jsonl", tmp_path / "COST.json")
    assert all(model.coefficients[term] == 0 for term in VISION_TERMS), model.coefficients
    assert CostModel.load(tmp_path / "COST.json").coefficients == model.coefficients


def test_qwen3_vl_profiles_images_in_its_own_patches(tmp_path):
    cfg = load_run_config("qwen3vl-tiny-small-vocab", overrides=list(SMALL))
    vision = cfg.model.vision
    assert vision.patch_size == 16
    designed = {h * w for h, w in image_grids(cfg.data.max_pixels, vision.patch_size,
                                              cfg.model.projector.spatial_merge_size)}
    # Eight terms to fit: 5 measured steps of 4 micro-batches determine them; 3 do not.
    records = _profile("qwen3vl-tiny-small-vocab", tmp_path / "PROFILE.jsonl", steps=6)
    patches = [p for r in records if r["kind"] == "micro_batch" for s in r["samples"] for p in s["patches"]]
    assert patches and set(patches) <= designed, (sorted(set(patches)), sorted(designed))
    micro_batches = [r for r in records if r["kind"] == "micro_batch"]
    assert any(r["features"]["n_img"] > 0 for r in micro_batches)
    assert any(r["features"]["n_img"] == 0 for r in micro_batches)  # text rows too: the text terms fit
    model = _fit(tmp_path / "PROFILE.jsonl", tmp_path / "COST.json")
    assert model.micro_batch_overhead_s + sum(model.coefficients.values()) > 0


@pytest.mark.parametrize("preset", ["llava-onevision-tiny-small-vocab", "internvl3.5-tiny-small-vocab"])
def test_a_composed_family_profiles_the_images_its_processor_plans(tmp_path, preset):
    """The sweep's designed images go through the family's own processor (LLaVA-OneVision's anyres squares, or a
    padded square each where two share a sample, with their sizes for the packing; InternVL's tiles, between its
    ``<img>`` markers) and train: the sweep used to write Qwen's smart-resized grids and stopped these families
    at its first row."""
    records = _profile(preset, tmp_path / "PROFILE.jsonl", steps=3)
    micro_batches = [r for r in records if r["kind"] == "micro_batch"]
    with_images = [r for r in micro_batches if r["features"]["n_img"] > 0]
    side = load_run_config(preset).model.vision.image_size // load_run_config(preset).model.vision.patch_size
    patches = {p for r in with_images for s in r["samples"] for p in s["patches"]}
    print(f"\n{preset}: {len(with_images)} of {len(micro_batches)} micro-batches with images, patches per image "
          f"{sorted(patches)}")
    assert with_images and len(with_images) < len(micro_batches)
    assert all(p % (side * side) == 0 for p in patches)  # whole squares (tiles, crops) of the tower's side
