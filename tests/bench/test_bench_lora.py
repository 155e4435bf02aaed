"""``loongforge bench lora``: one invocation trains full fine-tuning and LoRA on the same model and
data and reports LoRA's trainable parameters, checkpoint bytes, peak memory and step time as
ratios of full's; the LoRA checkpoint holds the adapters alone.

The two ``loongforge train`` command lines the bench starts run forked from the tests' fork server
(``tests.forked_cli.run_cli``), as given: two fresh interpreters importing torch were a third of the test.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from typer.testing import CliRunner

from loongforge.bench import lora as lora_bench
from loongforge.cli.app import app
from tests.forked_cli import run_cli


def _forked_run(command: list[str], **options):
    """``subprocess.run`` of a ``loongforge`` command line, the command forked instead of started."""
    assert command[:3] == [sys.executable, "-m", "loongforge.cli.app"] and options == {"capture_output": True,
                                                                                      "text": True}, command
    return run_cli(command[3:])


def test_bench_lora_measures_both_variants_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setattr(lora_bench, "subprocess", SimpleNamespace(run=_forked_run))
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
