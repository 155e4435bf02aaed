"""The pipeline in the plan: the bubble model, the uneven split that evens the ranks' work, the dry
run's stage table and ``--suggest-layout`` on tiny and full-size presets."""

import pytest
from typer.testing import CliRunner

from loongforge.cli.app import app
from loongforge.config.loader import load_run_config
from loongforge.config.pipeline_layout import PipelineStages, parse_stages, stage_plan
from loongforge.train.pipeline_plan import (
    StageWork,
    balanced_stages,
    equal_stage_bubble,
    pipeline_table,
    predicted_timing,
    row_work,
    suggest_layouts,
)


def test_equal_stages_give_the_textbook_bubble():
    assert equal_stage_bubble(2, 1, 4) == pytest.approx(1 / 5)  # 1F1B: (PP-1) / (M+PP-1)
    assert equal_stage_bubble(2, 2, 4) == pytest.approx(1 / 9)  # interleaved: (PP-1) / (VP M + PP-1)
    assert equal_stage_bubble(4, 2, 8) == pytest.approx(3 / 19)
    for pipeline, virtual, micro_batches in ((2, 1, 4), (2, 4, 8), (4, 2, 8), (8, 3, 16)):
        chunks = [[1.0] * virtual for _ in range(pipeline)]
        timing = predicted_timing(chunks, micro_batches)
        assert timing.bubble == pytest.approx(equal_stage_bubble(pipeline, virtual, micro_batches))
        assert timing.step == pytest.approx(micro_batches * virtual + pipeline - 1)


def test_a_heavy_first_stage_is_the_steps_pace_and_the_balanced_split_takes_layers_off_it():
    work = StageWork(per_layer=1.0, encoder=3.0, head=0.5)  # the encoder costs three layers
    even = PipelineStages(((4,), (4,)))
    assert predicted_timing(work.chunks(even), 8).step == pytest.approx(7 * 7 + 7 + 4.5)
    balanced = balanced_stages(8, 2, 1, work)
    print(f"balanced split {balanced.layers}: step {predicted_timing(work.chunks(balanced), 8).step} "
          f"vs even {predicted_timing(work.chunks(even), 8).step}")
    assert balanced.layers == ((3,), (5,))  # 6 vs 5.5 instead of 7 vs 4.5
    assert predicted_timing(work.chunks(balanced), 8).step < predicted_timing(work.chunks(even), 8).step
    # DeepStack-style floor: the first stage keeps at least 4 layers
    assert balanced_stages(8, 2, 1, work, first_stage_min=4).layers == ((4,), (4,))


def test_a_hybrid_decoders_stages_count_their_own_layers():
    """qwen3.5-tiny's layers (3 Gated DeltaNet, then gated attention) at PP 2: the second stage holds the
    attention layer, whose 1k-token row costs more than a linear layer's; each chunk sums its own layers."""
    cfg = load_run_config("qwen3.5-tiny", overrides=["data.seq_len=1024"])
    work = row_work(cfg)
    linear, full = work.layers[0], work.layers[3]
    assert work.layers == (linear, linear, linear, full) and full > linear
    assert work.per_layer == pytest.approx(sum(work.layers) / 4)
    chunks = work.chunks(PipelineStages(((2,), (2,))))
    assert chunks[0][0] == pytest.approx(2 * linear + work.encoder)
    assert chunks[1][0] == pytest.approx(linear + full + work.head)
    print(f"\nqwen3.5-tiny at 1k tokens: linear layer {linear / 1e9:.3f} GFLOP, attention layer {full / 1e9:.3f}")


@pytest.mark.parametrize("preset, overrides, layers", [
    ("qwen2.5vl-tiny", ["parallel.virtual_pipeline_model_parallel_size=2"], ["0", "1", "2", "3"]),
    ("llm-tiny", ["parallel.virtual_pipeline_model_parallel_size=2"], ["0", "1", "2", "3"]),
    # DeepStack's two layers on the first stage: an uneven layout over 8 layers.
    ("qwen3vl-tiny", ["model.language.num_layers=8", "parallel.pipeline_layout=Ett|tt|t|tttL"],
     ["0-1", "2-3", "4", "5-7"]),
])
def test_the_tiny_presets_at_pp2_x_vp2_state_every_stage(preset, overrides, layers):
    cfg = load_run_config(preset, overrides=["parallel.world_size=2", "parallel.pipeline_model_parallel_size=2",
                                             *overrides])
    table = pipeline_table(cfg)
    print(table)
    assert "interleaved 1F1B, 2 chunks per rank" in table
    rows = [line.split() for line in table.splitlines()[2:-1]]
    assert [(row[0], row[1], row[2]) for row in rows] == list(zip("0123", "0101", layers))
    assert "vision encoder" in table.splitlines()[2] or preset == "llm-tiny"
    assert "LM head" in table.splitlines()[5] and "predicted bubble" in table.splitlines()[-1]


def test_the_tiny_preset_moves_layers_off_the_lm_heads_stage():
    # A 152k-token head over a 128-wide model outweighs the layers: the last stage gets fewer.
    # At 2 processes no pipeline (DP 2) is faster still: it comes first.
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["parallel.world_size=2", "parallel.pipeline_model_parallel_size=2"])
    candidates = suggest_layouts(cfg)
    print(candidates)
    assert (candidates[0].pipeline, candidates[0].timing.bubble) == (1, 0.0)
    best = next(c for c in candidates if c.pipeline == 2)
    assert (best.virtual, best.layout) == (1, "Et*3|tL")


@pytest.mark.parametrize("preset", ["qwen3vl-235b-a22b", "qwen2.5vl-72b"])
def test_big_presets_state_a_layout_whose_bubble_beats_even_1f1b(preset):
    cfg = load_run_config(preset)
    stages = stage_plan(cfg.model.language.num_layers, cfg.parallel)
    assert stages.virtual > 1
    micro_batches = cfg.training.global_batch_size // (cfg.parallel.world_size // (
        cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size))
    work = row_work(cfg)
    stated = predicted_timing(work.chunks(stages), micro_batches)
    even = predicted_timing(work.chunks(PipelineStages(tuple(
        (cfg.model.language.num_layers // stages.pipeline,) for _ in range(stages.pipeline)))), micro_batches)
    print(f"{preset}: bubble {stated.bubble:.3f} stated, {even.bubble:.3f} with even 1F1B stages")
    assert stated.bubble < even.bubble / 2
    best = suggest_layouts(cfg)[0]
    assert best.timing.step <= stated.step
    if best.layout:
        assert len(parse_stages(best.layout)) == best.pipeline * best.virtual


def test_the_dry_run_prints_the_stage_table_and_the_suggestion():
    result = CliRunner().invoke(app, ["train", "--preset", "qwen3vl-235b-a22b", "--dry-run", "--suggest-layout"])
    assert result.exit_code == 0, result.output
    assert "pipeline stages (interleaved 1F1B, 4 chunks per rank" in result.output
    assert "suggest-layout (world 128, TP 4, CP 1 kept" in result.output
    assert "best: run with parallel.pipeline_model_parallel_size=2" in result.output
    refused = CliRunner().invoke(app, ["train", "--preset", "llm-tiny", "--suggest-layout"])
    assert refused.exit_code == 2 and "add --dry-run" in refused.output
