"""Issue 13's table: per-step loss and grad norm of the same training at several parallel layouts.

The tiny preset with 4 KV groups (8 query heads, the model of tests/train/test_layout_invariance.py)
on the LLaMA-Factory demo conversations with images, the same data, seed and initial weights, clipping
active (optimizer.clip_grad=1.0 below the grad norms). Each layout trains in its own temp folder via
the CLI; the table compares every layout's metrics.jsonl with TP 1.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/layout_invariance_table.py [--steps 3] [--layouts tp1,pp2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEMO = Path(os.environ.get("LOONGFORGE_SHARED", "/work/shared")) / "data" / "llamafactory" / "mllm_demo.json"
SEED = 1234
CLIP_GRAD = 1.0

COMMON = (  # the tiny preset (4 layers) with the 4-KV-group heads of the invariance test
    "model.language.num_attention_heads=8",
    "model.language.num_query_groups=4", "model.language.mrope_section=[2,3,3]",
    "data.source=files", f"data.paths=[{DEMO}]", "data.read=global",
    "data.seq_len=384",  # the longest demo conversation (two images) fits: nothing is rejected
    f"data.seed={SEED}", f"training.seed={SEED}",
    "training.global_batch_size=4", "schedule.warmup_steps=1", f"optimizer.clip_grad={CLIP_GRAD}",
    "logging.log_interval=1", "logging.progress_bar=false", "logging.tensorboard=false",
    "checkpoint.save_at_end=false",
)

# name -> (processes, overrides); the first layout run is the reference
LAYOUTS = {
    "tp1": (1, ()),
    "tp2": (2, ("parallel.tensor_model_parallel_size=2",)),
    "tp4-vision-tp2": (4, ("parallel.tensor_model_parallel_size=4",
                           "parallel.vision_tensor_model_parallel_size=2")),
    "pp2": (2, ("parallel.pipeline_model_parallel_size=2",)),
    "dp2": (2, ()),
}


def train(name: str, steps: int, out: Path) -> dict:
    nproc, extra = LAYOUTS[name]
    cmd = [sys.executable, "-m", "loongforge.cli.app", "train", "--preset", "qwen2.5vl-tiny", *COMMON,
           f"training.train_steps={steps}", f"logging.output_dir={out}", *extra]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rejects = json.loads((out / "summary.json").read_text()).get("rejects", {})
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows], "rejects": rejects}


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", default="tp1,tp2,tp4-vision-tp2,pp2",
                        help=f"comma-separated, the first is the reference; from {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    names = args.layouts.split(",")
    with tempfile.TemporaryDirectory(prefix="layout_invariance_") as tmp:
        runs = {name: train(name, args.steps, Path(tmp) / name) for name in names}
    ref = runs[names[0]]
    steps = range(1, args.steps + 1)
    print("| layout | processes | " + " | ".join(f"loss {s}" for s in steps) + " | "
          + " | ".join(f"grad norm {s}" for s in steps) + f" | max rel. diff vs {names[0]} |")
    print("|---" * (3 + 2 * args.steps) + "|")
    for name, run in runs.items():
        diff = max(rel(run["loss"], ref["loss"]), rel(run["grad_norm"], ref["grad_norm"]))
        print(f"| {name} | {LAYOUTS[name][0]} | " + " | ".join(f"{x:.6f}" for x in run["loss"]) + " | "
              + " | ".join(f"{x:.6f}" for x in run["grad_norm"]) + f" | {diff:.1e} |")
    print(f"\nrejected samples: { {name: sum(run['rejects'].values()) for name, run in runs.items()} }; "
          f"clipping active at every step: {min(ref['grad_norm']) > CLIP_GRAD}")
    if "pp2" in runs and "tp1" in runs:  # step 1 runs on the initial weights
        same = all(abs(runs["pp2"][k][0] - runs["tp1"][k][0]) <= 1e-6 * abs(runs["tp1"][k][0])
                   for k in ("loss", "grad_norm"))
        print(f"PP 2 vs PP 1 initial weights: step-1 loss and grad norm equal to 1e-6: {same}")


if __name__ == "__main__":
    main()
