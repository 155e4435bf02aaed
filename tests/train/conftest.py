"""Shared helpers: run `loongforge train` in fresh processes on a very small Qwen2.5-VL and read the results.

Training tests run the real command line in fresh processes, so each run initialises its own
process groups (gloo on 127.0.0.1) and nothing leaks into the pytest process. A run expected to
succeed forks its ranks from the tests' fork server (torch, megatron-core and the training code
imported once per session; each rank runs the command line in-process, as under torchrun): a fresh
interpreter per run spent ~4 s of CPU importing them, more than a tiny run's steps. Runs that test
the launcher itself, an exit code or a process environment go through a subprocess. They train the
``*-small-vocab`` presets (a 4k cut of the real BPE: the full 152k vocabulary would be 95% of every
step and checkpoint) and save no checkpoint unless they read one (``SAVE_AT_END``); a claim that a
resumed run equals the uninterrupted one resumes a cut-back copy of a finished run
(``resume_from_copy``) instead of training twice. docs/testing.md says what a new test should reuse.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.convert.checkpoint_folders import step_dir_name
from loongforge.convert.mcore_io import McoreReader
from loongforge.cli.app import app
from loongforge.models.registry import get_family
from loongforge.train.metrics import drop_metrics_after, read_metrics
from tests.console import assert_no_third_party_warning
from tests.shared_data import SHARED_DATA
from tests.forked_cli import run_cli
from tests.models.helpers import free_port, limit_threads, run_workers
from tests.train import plan_recorder

# What the training tests train unless they say otherwise: qwen2.5vl-tiny with the small vocabulary.
PRESET = "qwen2.5vl-tiny-small-vocab"

# A Qwen2.5-VL small enough for a few CPU steps in seconds, yet with every part exercised:
# windowed + full vision blocks, GQA, tied embeddings, images and text-only samples in packed rows.
SMALL_MODEL = [
    "model.language.num_layers=2",
    "data.seq_len=384",
    "data.synthetic_num_samples=96",
    "data.max_pixels=12544",  # 112 x 112: at most 16 image tokens per image
    "training.global_batch_size=4",
    "training.train_steps=4",
    "schedule.warmup_steps=1",
    "logging.log_interval=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "checkpoint.save_at_end=false",  # 4 of 5 runs never read one; those that do add SAVE_AT_END
]
SAVE_AT_END = "checkpoint.save_at_end=true"

# Small videos: 4 frames in a 12544-pixel clip budget (2 temporal patches of 2 tokens each).
SMALL_VIDEOS = ("data.video_max_frames=4", "data.video_min_pixels=3136", "data.video_max_pixels=12544")
# LLaMA-Factory's demo conversations: photos, then videos.
DEMO = SHARED_DATA / "llamafactory"
DEMO_MEDIA_FILES = ("data.source=files", f"data.paths=[{DEMO / 'mllm_demo.json'},{DEMO / 'mllm_video_demo.json'}]")

RUN_TIMEOUT_S = 420


def train_command(out_dir: Path, *extra: str, nproc: int = 1, resume: bool = False,
                  preset: str = PRESET, options: Sequence[str] = SMALL_MODEL) -> list[str]:
    """``options``: the tests' small-run settings (a run from an HF folder leaves out their model key)."""
    cmd = [sys.executable, "-m", "loongforge.cli.app", "train", "--preset", preset,
           *options, f"logging.output_dir={out_dir}", *extra]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    if resume:
        cmd.append("--resume")
    return cmd


def train_env(nproc: int = 1, env_extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1" if nproc > 1 else env.get("OMP_NUM_THREADS", "2")
    env.update(env_extra or {})
    return env


def run_train(out_dir: Path, *extra: str, nproc: int = 1, resume: bool = False,
              expect_ok: bool = True, env_extra: dict | None = None,
              preset: str = PRESET, launcher: bool = False,
              options: Sequence[str] = SMALL_MODEL) -> subprocess.CompletedProcess:
    """``loongforge train`` of the small model; stdout / stderr are rank 0's. ``launcher``: through
    a subprocess and the command's own launcher (``--nproc-per-node``), as also for ``env_extra`` and a
    run of several ranks that may fail; otherwise ranks forked from the tests' fork server (the module
    docstring), a single process that may fail as ``tests.forked_cli`` runs a command."""
    cmd = train_command(out_dir, *extra, nproc=nproc, resume=resume, preset=preset, options=options)
    if env_extra is None and not launcher:
        if expect_ok:
            return _run_forked(out_dir, cmd, nproc)
        if nproc == 1:
            return run_cli(cmd[3:])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=train_env(nproc, env_extra))
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


# What no command's stderr may hold (issue 30, item 13): a third-party warning (Python's warnings
# print "<file>:<line>: <Category>Warning: ..." and then the source line, often "warnings.warn("), a
# transformers log line, or a message about a feature the run leaves off (the online cost-model fit's
# term warnings with balancing off).
STDERR_NOISE = ("Warning: ", "warnings.warn", "[transformers]", "cost model warning")


def assert_quiet_stderr(stderr: str, what: str) -> None:
    assert_no_third_party_warning(stderr, what)  # the check of every subcommand, its count printed
    noisy = [line for line in stderr.splitlines() if any(noise in line for noise in STDERR_NOISE)]
    assert not noisy, f"{what}: stderr holds {noisy}"


def ranks_stderr(out_dir: Path) -> str:
    """Every rank's stderr of a forked ``run_train`` / ``run_recorded`` (its result holds rank 0's)."""
    logs = out_dir.parent / f"{out_dir.name}.logs"
    return "".join(path.read_text() for path in sorted(logs.glob("rank*.err")))


def _run_forked(out_dir: Path, command: list[str], nproc: int) -> subprocess.CompletedProcess:
    """``command`` (a train_command) as ``nproc`` ranks forked from the tests' fork server."""
    assert command[1:3] == ["-m", "loongforge.cli.app"]
    argv = command[3:]
    if "--nproc-per-node" in argv:  # the ranks are launched here, as torchrun would
        at = argv.index("--nproc-per-node")
        argv = argv[:at] + argv[at + 2:]
    logs = out_dir.parent / f"{out_dir.name}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    run_workers(_recorded_rank, nproc, (nproc, free_port(), str(out_dir), str(logs), argv, None), RUN_TIMEOUT_S)
    return subprocess.CompletedProcess(command, 0, stdout=(logs / "rank0.log").read_text(),
                                       stderr=(logs / "rank0.err").read_text())


def run_recorded(out_dir: Path, *extra: str, nproc: int, resume: bool = False, preset: str = PRESET,
                 record_batches: bool = False) -> str:
    """`run_train` of ``nproc`` ranks launched as torchrun would (RANK / WORLD_SIZE per process),
    each rank recording per step its plans, micro-batch sample ids and rows' stream positions to
    out_dir/plans_rank<r>.jsonl (tests.train.plan_recorder). The ranks are forked from the tests'
    fork server (``run_workers``: torch, megatron-core and the training code imported once per
    session), each running the command line in-process as under torchrun. With ``record_batches``
    each rank also saves its micro-batches per step to out_dir/batches_rank<r>/step<N>.pt. Returns
    rank 0's output."""
    command = train_command(out_dir, *extra, resume=resume, preset=preset)
    assert command[1:3] == ["-m", "loongforge.cli.app"]
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir.parent / f"{out_dir.name}.logs"
    logs.mkdir(exist_ok=True)
    run_workers(_recorded_rank, nproc, (nproc, free_port(), str(out_dir), str(logs), command[3:], record_batches),
                RUN_TIMEOUT_S)
    return (logs / "rank0.log").read_text() + (logs / "rank0.err").read_text()


def _recorded_rank(rank: int, nproc: int, port: int, out_dir: str, logs: str, argv: list[str],
                   record_batches: bool | None) -> None:
    """One rank of ``run_recorded`` / ``run_train``: the launch environment, stdout to
    logs/rank<r>.log and stderr to logs/rank<r>.err, the plan recorder (``record_batches`` not None),
    then ``loongforge`` in this process (it exits with the command's code)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    limit_threads()
    for stream, suffix in ((1, "log"), (2, "err")):
        with open(Path(logs) / f"rank{rank}.{suffix}", "w") as log:
            os.dup2(log.fileno(), stream)  # the descriptor stays open as stdout / stderr
    if record_batches is not None:
        batches = Path(out_dir) / f"batches_rank{rank}"
        if record_batches:
            batches.mkdir(exist_ok=True)
        plan_recorder.install(str(Path(out_dir) / f"plans_rank{rank}.jsonl"), str(batches) if record_batches else None)
    try:
        app(args=argv, prog_name="loongforge")
    except SystemExit as stop:
        if stop.code not in (0, None):  # the test sees the rank's own output, not only its exit code
            sys.stdout.flush()
            sys.stderr.flush()
            output = "".join((Path(logs) / f"rank{rank}.{suffix}").read_text()[-3000:] for suffix in ("log", "err"))
            raise RuntimeError(f"rank {rank} exited with {stop.code}:\n{output}") from None


def step_metric(out_dir: Path, key: str) -> list:
    return [r[key] for r in read_metrics(out_dir / "metrics.jsonl")]


def validation_losses(out_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{set name: [(step, loss), ...]} from a run's metrics.jsonl."""
    found: dict = {}
    for record in read_metrics(out_dir / "metrics.jsonl", validation=True):
        for name, result in record["validation"].items():
            found.setdefault(name, []).append((record["step"], result["loss"]))
    return found


def losses(out_dir: Path) -> list[float]:
    return step_metric(out_dir, "loss")


def grad_norms(out_dir: Path) -> list[float]:
    return step_metric(out_dir, "grad_norm")


def worst_relative(actual: list[float], expected: list[float]) -> float:
    """max |a - e| / |e| over the steps (the figure a tolerance is set from; tests print it)."""
    assert len(actual) == len(expected), (actual, expected)
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


def assert_close_relative(actual: list[float], expected: list[float], rel: float, what: str = "") -> None:
    """Every step within ``rel`` (relative); prints the worst difference against the bound."""
    print(f"{what or 'per-step values'}: worst relative difference {worst_relative(actual, expected):.1e} "
          f"(asserted <= {rel:.0e})")
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rel * abs(e), f"step {step}: {a} vs {e} (rel {abs(a - e) / abs(e):.2e})"


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory) -> Path:
    """The reference: one process, TP1 PP1 DP1, 4 steps of 4 rows, checkpoints at steps 2 and 4
    (for resumed copies). Its console output is kept beside the run folder (``<run>.stdout``,
    ``<run>.stderr``)."""
    out = tmp_path_factory.mktemp("baseline")
    proc = run_train(out, "checkpoint.save_interval=2", SAVE_AT_END)
    out.with_suffix(".stdout").write_text(proc.stdout)
    out.with_suffix(".stderr").write_text(proc.stderr)
    return out


def cut_back_copy(run: Path, out: Path, step: int) -> Path:
    """A copy of the finished ``run`` as if it had stopped right after saving at ``step``: later
    checkpoints and metrics lines are gone (``latest`` may still name a later step, which --resume
    then skips for the newest complete checkpoint), so whatever the copy logs after ``step`` can
    only come from a resumed run."""
    shutil.copytree(run, out)
    checkpoints = out / "checkpoints"
    for step_dir in checkpoints.iterdir():
        if step_dir.name.startswith("step_") and step_dir.name > step_dir_name(step):
            shutil.rmtree(step_dir)
    assert (checkpoints / step_dir_name(step)).is_dir(), f"{run} saved no checkpoint at step {step}"
    drop_metrics_after(out / "metrics.jsonl", step)
    return out


def resume_from_copy(run: Path, out: Path, step: int, *extra: str, nproc: int = 1,
                     **kwargs) -> subprocess.CompletedProcess:
    """Resume a cut-back copy of ``run`` (``cut_back_copy``) from ``step``: the cheap way to prove
    that a resumed run equals the uninterrupted one. ``extra`` repeats the run's own options."""
    cut_back_copy(run, out, step)
    proc = run_train(out, *extra, nproc=nproc, resume=True, **kwargs)
    output = proc.stdout + proc.stderr
    assert f"resumed from {out / 'checkpoints' / step_dir_name(step)} at step {step}" in output, output[-3000:]
    return proc


def assert_resumes_identically(uninterrupted: Path, resumed: Path, step: int, *extra: str,
                               pieces: tuple[str, ...] = (), **kwargs) -> None:
    """A cut-back copy of ``uninterrupted`` resumed from ``step`` (``resume_from_copy``; ``extra`` and ``kwargs`` its
    options) ends bit-identical: losses, grad norms and every checkpoint tensor, each of ``pieces`` (name pieces)
    among them."""
    resume_from_copy(uninterrupted, resumed, step, *extra, **kwargs)
    assert losses(resumed) == losses(uninterrupted)
    assert grad_norms(resumed) == grad_norms(uninterrupted)
    differences = checkpoint_differences(resumed, uninterrupted)
    for piece in pieces:
        assert any(piece in key for key in differences), piece
    print(f"\nresumed after step {step} vs uninterrupted: {len(differences)} tensors, largest difference "
          f"{max(differences.values()):.1e}")
    assert max(differences.values()) == 0.0, max(differences, key=differences.get)


def final_checkpoint(run: Path) -> Path:
    return sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))[-1]


def checkpoint_differences(run: Path, reference: Path) -> dict[str, float]:
    """|a - b| / |b| (Frobenius) of every tensor of the reference's final checkpoint, read from
    both (the distributed optimizer also saves its fp32 parameters, which the reference lacks)."""
    readers = [McoreReader(final_checkpoint(r) / "model_optim") for r in (run, reference)]
    # megatron-core chains one optimizer per parameter kind (dense, experts) under expert
    # parallelism and prefixes their state with "chained_<n>."; the names after it are unique.
    names = [{re.sub(r"^chained_\d+\.", "", key): key for key in reader.tensors} for reader in readers]
    missing = set(names[1]) - set(names[0])
    assert not missing, sorted(missing)[:5]
    differences = {}
    for key in names[1]:
        x, y = (reader.read(keys[key]).double() for reader, keys in zip(readers, names))
        differences[key] = float((x - y).norm() / y.norm()) if y.norm() > 0 else float((x - y).norm())
    return differences


def assert_trains_alike(run: Path, reference: Path, steps: slice = slice(None), relative: float = 1e-5,
                        checkpoint_relative: float | None = None) -> None:
    """Losses and grad norms (relative), Adam's moments (``checkpoint_relative``, else relative) and the
    weights (10x that: see below) of two runs' final checkpoints."""
    assert_close_relative(losses(run)[steps], losses(reference)[steps], relative, "losses")
    assert_close_relative(grad_norms(run)[steps], grad_norms(reference)[steps], relative, "grad norms")
    differences = checkpoint_differences(run, reference)
    moments = {k: v for k, v in differences.items() if k.startswith("optimizer.state.exp_avg")}
    assert any(key.startswith("optimizer.state.exp_avg.vision_model") for key in moments)
    worst = max(moments, key=moments.get)
    bound = relative if checkpoint_relative is None else checkpoint_relative
    print(f"Adam moments: worst relative difference {moments[worst]:.1e} ({worst}; asserted <= {bound:.0e})")
    assert moments[worst] <= bound, (worst, moments[worst])
    # Adam turns a gradient that is ~0 up to rounding into a full step either way: weights that
    # start at 0 (biases) carry 1e-5-level differences.
    weights = {k: v for k, v in differences.items() if not k.startswith("optimizer.")}
    worst = max(weights, key=weights.get)
    print(f"weights: worst relative difference {weights[worst]:.1e} ({worst}; asserted <= {10 * bound:.0e})")
    assert weights[worst] <= 10 * bound, (worst, weights[worst])


def random_hf_folder(preset: str, overrides: list[str], folder: Path) -> None:
    """The preset's architecture as a transformers model with every parameter random, saved."""
    import transformers

    model_cfg = load_run_config(preset, overrides=overrides).model
    family = get_family(model_cfg.family)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(family.config_to_hf(model_cfg, "float32")))
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model_class = getattr(transformers, family.hf_model_class)
    model = (model_class.from_config(config) if model_class.__name__.startswith("Auto") else model_class(config)).float()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_q" in name else 0.05 * noise)
    model.save_pretrained(folder)


# A family's layout proof: one process, DP 2 with balancing re-planning every step, TP 2 x PP 2.
LAYOUT_LAUNCHES = (("dp1", (), 1), ("dp2", ("balance.enabled=true", "balance.threshold=0"), 2),
                   ("tp2-pp2", ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"), 4))
# DP 2 with balancing takes no family code beyond what one process runs (rows, media collation and the loss
# are the same; megatron's DDP reduces the gradients): Qwen2.5-VL proves it (test_layout_invariance.py), and
# Qwen3-VL and the text family, whose resume tests take their DP 2 run. Other families prove their own
# layers' split: TP 2 x PP 2.
FAMILY_LAYOUTS = ("dp1", "tp2-pp2")


def launch_runs(root: Path, preset: str, *options: str,
                launches: Mapping[str, tuple[tuple[str, ...], int]]) -> dict[str, Path]:
    """``preset`` trained with ``options`` once per launch (name: its own options, its process count), each
    run in ``root / name``; the runs by name."""
    for name, (extra, nproc) in launches.items():
        run_train(root / name, *options, *extra, nproc=nproc, preset=preset)
    return {name: root / name for name in launches}


def layout_runs(root: Path, preset: str, *options: str,
                layouts: tuple[str, ...] = tuple(name for name, _, _ in LAYOUT_LAUNCHES)) -> dict[str, Path]:
    """The ``LAYOUT_LAUNCHES`` named in ``layouts`` of ``preset`` with ``options``, by name."""
    launches = {name: (extra, nproc) for name, extra, nproc in LAYOUT_LAUNCHES if name in layouts}
    return launch_runs(root, preset, *options, launches=launches)


def expert_bias(run: Path, suffix: str = "mlp.router.expert_bias") -> dict[str, list[float]]:
    """The routers' expert biases (sigmoid routing's load-balancing bias) in ``run``'s final checkpoint, by key."""
    reader = McoreReader(final_checkpoint(run) / "model_optim")
    return {key: reader.read(key).tolist() for key in reader.tensors if key.endswith(suffix)}


def assert_state_alike(run: Path, reference: Path, bound: float, label: str, moment_pieces: tuple[str, ...]) -> None:
    """Adam's moments and the weights of ``run``'s final checkpoint within ``bound`` (relative) of ``reference``'s, each
    of ``moment_pieces`` (name pieces) among the moments compared; prints the worst of each, and of the losses and
    grad norms."""
    differences = checkpoint_differences(run, reference)
    moments = {k: v for k, v in differences.items() if k.startswith("optimizer.state.exp_avg")}
    for piece in moment_pieces:
        assert any(piece in k for k in moments), (piece, sorted(moments)[:5])
    worst = max(moments, key=moments.get)
    weights = {k: v for k, v in differences.items() if not k.startswith("optimizer.")}
    worst_weight = max(weights, key=weights.get)
    print(f"\n{label} vs one process: losses {worst_relative(losses(run), losses(reference)):.1e}, grad norms "
          f"{worst_relative(grad_norms(run), grad_norms(reference)):.1e}, moments {moments[worst]:.1e} ({worst}), "
          f"weights {weights[worst_weight]:.1e} (worst relative difference)")
    assert moments[worst] <= bound, (worst, moments[worst])
    assert weights[worst_weight] <= bound, (worst_weight, weights[worst_weight])


def assert_layout_trains_like_one_process(runs: dict[str, Path], layout: str, relative: float,
                                          tensors: tuple[str, ...] = (), elsewhere: tuple[str, ...] = ()) -> None:
    """Losses, grad norms and Adam's moments of ``runs[layout]`` within ``relative`` of one process's, the
    loss falling; each of ``tensors`` (name pieces) among the moments compared (those parts trained).
    Moments whose names hold a piece of ``elsewhere`` are left to the caller's own bound."""
    reference = runs["dp1"]
    assert losses(reference)[-1] < losses(reference)[0]
    assert_close_relative(losses(runs[layout]), losses(reference), relative)
    assert_close_relative(grad_norms(runs[layout]), grad_norms(reference), relative)
    moments = {k: v for k, v in checkpoint_differences(runs[layout], reference).items()
               if k.startswith("optimizer.state.exp_avg") and not any(piece in k for piece in elsewhere)}
    for tensor in tensors:
        assert any(tensor in key for key in moments), tensor
    worst = max(moments, key=moments.get)
    assert moments[worst] <= relative, (worst, moments[worst])
    print(f"\n{layout} vs one process: losses {worst_relative(losses(runs[layout]), losses(reference)):.1e}, "
          f"grad norms {worst_relative(grad_norms(runs[layout]), grad_norms(reference)):.1e}, "
          f"Adam moments {moments[worst]:.1e} ({worst})")


def assert_stored_embeddings_train_like_the_frozen_encoder(out: Path, preset: str, data: Path, *options: str,
                                                           relative: float = 1e-5) -> None:
    """``loongforge encode`` of ``data`` (its ``options`` as ``--set``), then 4 steps on the stored features
    against 4 steps with the towers online and frozen: the same rejects (a sample whose stored features
    are missing or of another grid is a ``missing_embedding`` one), losses and grad norms within
    ``relative``."""
    store = out / "embeddings"
    sets = [arg for option in options for arg in ("--set", option)]
    proc = run_cli(["encode", str(data), "--output", str(store), "--preset", preset, "--dtype", "fp32",
                    "--no-progress", *sets])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = ("data.source=files", f"data.paths=[{data}]", "training.train_steps=4", "training.global_batch_size=2",
           *options)
    run_train(out / "online", *run, "training.freeze_vision=true", "training.freeze_projector=true", preset=preset)
    run_train(out / "stored", *run, f"data.vision_embeddings={store}", preset=preset)
    rejects = {name: _reject_lines(out / name) for name in ("online", "stored")}
    print(f"\n{preset} on {data.name}: {len(rejects['online'])} samples rejected online, "
          f"{len(rejects['stored'])} on stored features")
    assert rejects["stored"] == rejects["online"]
    assert_close_relative(losses(out / "stored"), losses(out / "online"), relative)
    assert_close_relative(grad_norms(out / "stored"), grad_norms(out / "online"), relative)


def _reject_lines(run: Path) -> list[str]:
    path = run / "rejects.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors
