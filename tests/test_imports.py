"""What a training rank imports before its first step: packages that only some runs use are imported
where they are used, not by ``import loongforge.train.runner`` (issue 29: every process starts faster).

Each check runs in a fresh interpreter: this one has imported whatever earlier tests needed.
"""

import json
import subprocess
import sys

# transformers (~1.5 s: tokenizers are built or exported), datasets (~0.7 s: data.source=files),
# torch._dynamo and torch._inductor (~1.5 s: megatron-core's jit_fuser compiles on first call).
NOT_IMPORTED_BY_THE_RUNNER = ("transformers", "datasets", "torch._dynamo", "torch._inductor")


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_the_runner_imports_no_optional_heavy_package():
    loaded = _modules_after("import loongforge.train.runner")
    found = [name for name in NOT_IMPORTED_BY_THE_RUNNER if name in loaded]
    assert "megatron.core.transformer" in loaded  # the model code is there, and with it megatron-core
    assert not found, f"import loongforge.train.runner imported {found}"


def test_reading_and_writing_checkpoints_imports_dcp_when_used():
    """model_io (HF weights in, a checkpoint out as HF) leaves torch.distributed.checkpoint to its
    first use. Not checked on the runner: megatron-core imports it itself, through torch's DTensor
    compatibility module (``megatron.core.utils`` -> ``torch.distributed._tensor``)."""
    loaded = _modules_after("import loongforge.convert.model_io")
    found = [name for name in ("torch.distributed.checkpoint", "transformers", "datasets") if name in loaded]
    assert not found, f"import loongforge.convert.model_io imported {found}"
