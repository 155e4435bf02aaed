"""``loongforge bench lora``: one invocation trains full fine-tuning and LoRA on the same model and
data and reports LoRA's trainable parameters, checkpoint bytes, peak memory and step time as
ratios of full's; the LoRA checkpoint holds the adapters alone."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from loongforge.cli.app import app


def test_bench_lora_measures_both_variants_in_one_run(tmp_path):
    doc = tmp_path / "lora.md"
    result = CliRunner().invoke(app, ["bench", "lora", "model.language.num_layers=2", "training.train_steps=2",
                                      "--rank", "8", "--warmup-steps", "1", "--out", str(tmp_path / "out"),
                                      "--doc", str(doc)])
    assert result.exit_code == 0, result.output
    measures = json.loads((tmp_path / "out" / "lora.json").read_text())
    full, lora = measures["full"], measures["lora"]
    checkpoint_ratio = full["checkpoint_bytes"] / lora["checkpoint_bytes"]
    print(f"tiny: trainable {full['trainable_parameters']:,} vs {lora['trainable_parameters']:,}; checkpoint "
          f"{checkpoint_ratio:.1f}x smaller; step {lora['step_s'] / full['step_s']:.2f}x")
    assert full["trainable_parameters"] > 10 * lora["trainable_parameters"]
    assert checkpoint_ratio > 8  # measured 25x: the adapters and their Adam moments alone
    assert "| checkpoint on disk |" in doc.read_text()
