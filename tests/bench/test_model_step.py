"""`loongforge bench model`: the FLOP count against a hand count, the benchmark's inputs, and the
command on CPU at toy size."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from loongforge.balance.cost_model import SampleCost
from loongforge.bench.model_step import ModelBenchOptions, bench_run_config, build_inputs, design_row, transformers_inputs
from loongforge.calibrate.sweep import SweepSource
from loongforge.cli.app import app
from loongforge.config.schema import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig, WindowAttentionConfig
from loongforge.models.registry import get_family
from tests.console import assert_no_third_party_warning, console_of


def _small_model() -> ModelConfig:
    return ModelConfig(
        vision=VisionConfig(depth=2, hidden_size=4, intermediate_size=8, num_heads=1, patch_size=14,
                            temporal_patch_size=2, window=WindowAttentionConfig(size=112, fullatt_block_indexes=[1])),
        projector=ProjectorConfig(spatial_merge_size=2, out_hidden_size=6),
        language=LanguageConfig(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                                num_query_groups=1, vocab_size=10, mrope_section=[1, 0, 0]),
    )


def test_flops_equal_a_hand_count():
    # One image of 4 x 12 patches (48 patches, 2 x 6 merge units), segments of 10 and 6 tokens,
    # 14 loss tokens. Windows are 4 x 4 merge units: 2 x 4 units (32 patches) and 2 x 2 (16).
    samples = [SampleCost(tokens=10, patches=(48,), loss_tokens=14, grids=((1, 4, 12),)), SampleCost(tokens=6)]
    flops = get_family("qwen2_5_vl").training_flops(_small_model(), samples)
    patch_embed = 48 * 2 * 1176 * 4  # pixels per patch 3*2*14*14 = 1176 -> width 4
    blocks = 2 * 48 * 2 * (3 * 4 * 4 + 4 * 4 + 3 * 4 * 8)  # qkv, proj, SwiGLU per patch and block
    attention = 4 * 4 * (48 ** 2) + 4 * 4 * (32 ** 2 + 16 ** 2)  # full block, then window block
    # The patch embedding's backward is its weight gradient only: pixels take no gradient.
    assert flops.vision == 2 * patch_embed + 3 * (blocks + attention) == 1167360
    assert flops.projector == 3 * 12 * 2 * (16 * 16 + 16 * 6) == 3 * 8448
    linear = 16 * 2 * (4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8)  # kv width: 1 group of head_dim 2
    # Attention over each segment's full L x L square (q width 2 heads x 2): 4 * L^2 * 4.
    assert flops.language == 3 * (linear + 4 * 4 * (10 ** 2 + 6 ** 2)) == 3 * 6784
    assert flops.lm_head == 3 * 2 * 4 * 10 * 14
    assert flops.total == 1216416 and flops.to_dict()["total"] == flops.total


def _tiny_options(**kwargs) -> ModelBenchOptions:
    defaults = dict(preset="qwen2.5vl-tiny", language_layers=None, vision_blocks=None, tokens=512,
                    samples=2, device="cpu", dtype="fp32")
    return ModelBenchOptions(**{**defaults, **kwargs})


def test_packed_row_and_batch_hold_the_same_equal_length_samples():
    opts = _tiny_options()
    cfg = bench_run_config(opts)
    inputs = build_inputs(cfg, opts)
    packed, batch = inputs.packed, inputs.batch
    assert inputs.segment_lengths == [256, 256] and packed["cu_seqlens"].tolist() == [0, 256, 512]
    assert torch.equal(batch["input_ids"].reshape(1, -1), packed["input_ids"])  # [2, 256] vs [1, 512]
    assert torch.equal(batch["position_ids"].reshape(3, 1, -1), packed["position_ids"])
    # Loss on every token but each sample's last, so every variant's LM head sees the same tokens.
    assert inputs.loss_tokens == 510 and batch["loss_mask"][:, -1].sum() == 0
    # 448x448 and 1280x720 shrink to the tiny preset's 224x224 pixel budget.
    assert inputs.grids == [(1, 16, 16), (1, 12, 20)]
    # The FLOP count's view: each sample with its own image and its loss tokens.
    assert [(s.tokens, s.grids, s.loss_tokens) for s in inputs.samples] == [
        (256, ((1, 16, 16),), 255), (256, ((1, 12, 20),), 255)]
    assert int((packed["input_ids"] == cfg.model.tokens.image_token_id).sum()) == (256 + 240) // 4


@pytest.mark.parametrize("preset", ["llava-onevision-tiny", "internvl3.5-tiny"])
def test_a_composed_familys_row_holds_its_processors_images_and_transformers_gets_1d_positions(preset):
    """``bench model`` on a family with its own processor and 1-D RoPE: the row's images are the processor's
    (LLaVA-OneVision's anyres squares with their sizes, InternVL's tiles) and its transformers baseline gets
    positions [samples, L] (it was given the three M-RoPE rows, and the row builder stopped at its first
    text token)."""
    opts = _tiny_options(preset=preset, tokens=2048)
    cfg = bench_run_config(opts)
    inputs = build_inputs(cfg, opts)
    images = inputs.packed["media"].images
    side = cfg.model.vision.image_size // cfg.model.vision.patch_size
    print(f"\n{preset}: grids {inputs.grids}, sizes {images.sizes.tolist()}")
    assert images.sizes.tolist() == [[448, 448], [720, 1280]]
    assert all((h, w) == (side, side) and t > 1 for t, h, w in inputs.grids)  # whole squares, several each
    assert transformers_inputs(cfg, inputs.batch)["position_ids"].shape == inputs.batch["input_ids"].shape


def test_an_image_larger_than_its_sample_is_left_out():
    opts = _tiny_options(tokens=64, samples=2)
    cfg = bench_run_config(opts)
    assert design_row(cfg, opts, SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=1)) == [(32, []), (32, [])]


def _samples_of(stack: dict) -> list[SampleCost]:
    """The bench's row as SampleCosts: the count is a sum over samples and over media, so which
    sample holds which image (the stack does not say) does not change it."""
    lengths, grids = stack["segment_lengths"], [tuple(g) for g in stack["image_grids_thw"]]
    first = SampleCost(tokens=lengths[0], patches=tuple(t * h * w for t, h, w in grids),
                       loss_tokens=stack["loss_tokens"], grids=tuple(grids))
    return [first, *(SampleCost(tokens=length) for length in lengths[1:])]


def _restore_launch_env_afterwards(monkeypatch) -> None:
    """The bench sets RANK, MASTER_PORT, ... for its world of one; later tests must not see them."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "unset")  # records the original value (or its absence) for undo
        monkeypatch.delenv(key)


def test_bench_model_on_cpu_reports_tokens_per_s_and_mfu(tmp_path, monkeypatch, capfd):
    _restore_launch_env_afterwards(monkeypatch)
    out = tmp_path / "result.json"
    result, stderr = console_of(capfd, lambda: CliRunner().invoke(app, [
        "bench", "model", "--preset", "qwen2.5vl-tiny", "--language-layers", "1", "--vision-blocks", "0",
        "--tokens", "256", "--samples", "2", "--steps", "2", "--warmup-steps", "0", "--device", "cpu",
        "--dtype", "fp32", "--peak-tflops", "0.5", "--output", str(out), "--json"]))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "bench model")
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["runs"]] == ["loongforge_packed", "loongforge_batch", "transformers_batch"]
    stack = data["stack"]
    assert stack["language_layers"] == 1 and stack["vision_blocks"] == 2 and stack["tokens"] == 256
    cfg = bench_run_config(_tiny_options(language_layers=1, tokens=256))
    expected = get_family(cfg.model.family).training_flops(cfg.model, _samples_of(stack))
    assert data["flops_per_step"]["total"] == expected.total
    for run in data["runs"]:
        assert run["tokens_per_s"] == pytest.approx(256 / run["step_s_median"])
        assert run["mfu"] == pytest.approx(expected.total / run["step_s_median"] / 0.5e12)
    assert set(data["ratios"]) == {"loongforge_packed/transformers_batch", "loongforge_batch/transformers_batch"}
    assert data["peak_tflops"] == 0.5 and data["environment"]["device_type"] == "cpu"


@pytest.mark.parametrize("args, message", [
    (["--tokens", "100", "--samples", "3"], "must be a multiple of --samples"),
    (["--images", "448by448"], "expected WIDTHxHEIGHT"),
    (["--dtype", "fp16"], "--dtype 'fp16' is not one of"),
])
def test_usage_errors_exit_2(args, message):
    result = CliRunner().invoke(app, ["bench", "model", "--device", "cpu", *args])
    assert result.exit_code == 2 and message in result.output
