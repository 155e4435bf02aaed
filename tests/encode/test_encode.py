"""``loongforge encode`` on real images and videos (the LoongForge mix: text-only, one-image,
two-image and video samples): stored embeddings equal the training model's encoder output, a
SIGKILL then ``--resume`` leaves exactly what an uninterrupted run writes, two processes store what
one does, and bad input is a reject or a one-line usage error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.config.schema import ParallelConfig
from loongforge.data.conversations import read_data_file
from loongforge.data.embedding_store import EmbeddingRow, EmbeddingStore
from loongforge.data.measure import MeasuredSample, image_pixels, video_pixels, vision_sizing
from loongforge.data.vision import plan_video, probe_video
from loongforge.models.registry import get_family
from tests.console import assert_no_third_party_warning
from tests.forked_cli import run_cli
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.shared_data import SHARED_DATA

MIX = SHARED_DATA / "loongforge" / "vlm" / "mix.json"
PRESET = "qwen2.5vl-tiny"
SETTINGS = ("data.max_pixels=50176", "data.video_max_frames=4", "data.video_min_pixels=12544",
            "data.video_max_pixels=50176")
# Small shards and batches: several shards per run, media batched together and alone.
FLAGS = ("--dtype", "fp32", "--shard-tokens", "100", "--batch-patches", "600", "--no-progress")
TIMEOUT_S = 300

# Runs the CLI in a fresh process that SIGKILLs itself right after its second shard is on disk.
KILL_AFTER_TWO_SHARDS = """
import os, signal, sys
from loongforge.encode import worker
from loongforge.cli.app import app

real_write, written = worker._write_shard, []

def write_then_maybe_die(*args, **kwargs):
    real_write(*args, **kwargs)
    written.append(args[0])
    if len(written) == 2:
        os.kill(os.getpid(), signal.SIGKILL)

worker._write_shard = write_then_maybe_die
app(sys.argv[1:])
"""


def _command(out: Path, *extra: str, inputs=(MIX,)) -> list[str]:
    sets = [arg for setting in SETTINGS for arg in ("--set", setting)]
    return [*map(str, inputs), "--output", str(out), "--preset", PRESET, *FLAGS, *sets, *extra]


def _encode(out: Path, *extra: str, inputs=(MIX,), script: str | None = None) -> subprocess.CompletedProcess:
    """One ``loongforge encode``: forked (``tests.forked_cli``), or a fresh interpreter for a ``script``
    (a process to kill) and for a command that launches its own ranks."""
    argv = ["encode", *_command(out, *extra, inputs=inputs)]
    if script is None and "--nproc-per-node" not in extra:
        return run_cli(argv, timeout_s=TIMEOUT_S)
    prefix = [sys.executable, "-c", script] if script else [sys.executable, "-m", "loongforge.cli.app"]
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=TIMEOUT_S)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def encoded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("encode") / "mix"
    _ok(_encode(out))
    return out


def _tensors(root: Path) -> dict[tuple, torch.Tensor]:
    """(sample, kind, media index) -> stored features, whichever shard holds them."""
    store = EmbeddingStore(root)
    rows = [json.loads(line) for line in (root / "index.jsonl").read_text().splitlines()]
    return {(r["sample_id"], r["kind"], r["media_index"]): store.features(EmbeddingRow.from_json(r)) for r in rows}


def test_every_medium_of_the_mix_is_stored_and_counted(encoded):
    encoder = json.loads((encoded / "encoder.json").read_text())
    counts = encoder["counts"]
    assert (counts["samples"], counts["images"], counts["videos"], counts["rejected_samples"]) == (6, 4, 2, 0)
    assert counts["shards"] > 2
    assert encoder["weights_digest"].startswith("sha256:") and encoder["processor"]["video_max_frames"] == 4
    rows = [json.loads(line) for line in (encoded / "index.jsonl").read_text().splitlines()]
    kinds = [(r["line"], r["kind"], r["media_index"]) for r in rows]
    assert kinds == sorted(kinds)  # input order
    assert [r["kind"] for r in rows].count("image") == 4


def test_stored_embeddings_equal_the_training_models_encoder(encoded):
    """The same pixels through the training model's towers (``build``, not ``build_encoder``),
    from the same initial weights: max abs difference at most 1e-6 in fp32."""
    cfg = load_run_config(PRESET, overrides=list(SETTINGS))
    sizing = vision_sizing(cfg.data, cfg.model)
    init_megatron(0, 1, free_port())
    try:
        model = get_family(cfg.model.family).build(cfg.model, ParallelConfig(), params_dtype=torch.float32,
                                                   pre_process=True, post_process=True, device="cpu",
                                                   init_seed=cfg.training.seed).eval()
        worst, store = 0.0, EmbeddingStore(encoded)
        for row in (json.loads(line) for line in (encoded / "index.jsonl").read_text().splitlines()):
            pixels = _pixels_of(row, sizing, cfg.data)
            grid = torch.tensor([row["grid"]])
            with torch.no_grad():
                online = model.projector(model.vision_model(torch.from_numpy(pixels), grid))
            stored = store.features(EmbeddingRow.from_json(row))
            assert stored.shape == online.shape
            worst = max(worst, float((stored - online).abs().max()))
        assert worst <= 1e-6, worst
    finally:
        destroy_megatron()


def _pixels_of(row: dict, sizing, data_cfg):
    record = json.loads(MIX.read_text())
    line_of = _record_lines()
    sample = record[line_of.index(row["line"])]
    media = sample["images" if row["kind"] == "image" else "videos"][row["media_index"]]
    path = str(MIX.parent / media)
    if row["kind"] == "image":
        return image_pixels(path, tuple(row["grid"]), sizing)
    plan = plan_video(probe_video(path), sizing, data_cfg.video_fps, data_cfg.video_max_frames)
    return video_pixels(path, plan, sizing)


def _record_lines() -> list[int]:
    """The 1-based line each record of the mix starts on (how sample ids name them)."""
    return [located.line for located in read_data_file(MIX)]


def test_sigkill_then_resume_holds_exactly_what_an_uninterrupted_run_holds(encoded, tmp_path):
    out = tmp_path / "killed"
    killed = _encode(out, script=KILL_AFTER_TWO_SHARDS)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "encoder.json").exists() and len(list((out / "shards").iterdir())) == 2
    _ok(_encode(out, "--resume"))
    for name in ("index.jsonl", "rejects.jsonl", "encoder.json"):
        assert (out / name).read_text() == (encoded / name).read_text(), name
    shards = sorted(p.name for p in (encoded / "shards").iterdir())
    assert sorted(p.name for p in (out / "shards").iterdir()) == shards
    for name in shards:
        assert (out / "shards" / name).read_bytes() == (encoded / "shards" / name).read_bytes(), name


def test_two_processes_store_what_one_does(encoded, tmp_path):
    out = tmp_path / "two"
    proc = _ok(_encode(out, "--nproc-per-node", "2"))
    assert_no_third_party_warning(proc.stderr, "encode --nproc-per-node 2")  # both spawned ranks' stderr
    one, two = _tensors(encoded), _tensors(out)
    assert one.keys() == two.keys()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-6, rtol=0), key
    ranks = {p.name[:4] for p in (out / "shards").iterdir()}
    assert ranks == {"r000", "r001"}


def test_a_finished_folder_needs_resume_or_overwrite(encoded, tmp_path):
    again = _encode(encoded)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: output folder {encoded} is not empty; pass --resume to finish the run that wrote it, "
        f"--overwrite to start over, or choose a new folder")
    other = tmp_path / "not-encode"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    refused = _encode(other, "--overwrite")
    assert refused.returncode == 2 and (other / "notes.txt").exists()
    assert "is not a `loongforge encode` folder" in refused.stderr


def test_unreadable_media_are_rejects_with_file_line_and_reason(tmp_path):
    image = str(MIX.parent / "mllm_demo_data" / "1.jpg")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(Path(image).read_bytes()[:2000])
    records = [
        {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A photo."}],
         "images": [image]},
        {"messages": [{"role": "user", "content": "<image>And this?"}, {"role": "assistant", "content": "Gone."}],
         "images": [str(tmp_path / "missing.jpg")]},
        {"messages": [{"role": "user", "content": "<image>This?"}, {"role": "assistant", "content": "Broken."}],
         "images": [str(truncated)]},
    ]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    _ok(_encode(out, inputs=(data,)))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rejects] == [
        (str(data), 2, "missing_image"), (str(data), 3, "corrupt_image")]
    rows = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == [1]
    assert load_file(str(out / rows[0]["shard"]))[rows[0]["key"]].shape[0] == rows[0]["tokens"]


def test_records_sharing_a_line_are_found_apart(tmp_path):
    """A JSON array on one line (what many tools write): every record is line 1, yet each sample
    finds its own images' features, as training looks them up, and each reject names its record."""
    photos = sorted((MIX.parent / "mllm_demo_data").glob("*.jpg"))[:3]
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(photos[0].read_bytes()[:2000])
    records = [{"messages": [{"role": "user", "content": "<image>What is it?"},
                             {"role": "assistant", "content": f"Photo {i}."}], "images": [str(photo)]}
               for i, photo in enumerate([*photos, tmp_path / "missing.jpg", truncated])]
    data = tmp_path / "one_line.json"
    data.write_text(json.dumps(records))
    out = tmp_path / "out"
    _ok(_encode(out, inputs=(data,)))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["record"], r["reason"]) for r in rejects] == [
        (str(data), 1, 3, "missing_image"), (str(data), 1, 4, "corrupt_image")]
    store = EmbeddingStore(out)
    cfg = load_run_config(PRESET, overrides=list(SETTINGS))
    sizing = vision_sizing(cfg.data, cfg.model)
    found = []
    for record, photo in enumerate(photos):
        grid = sizing.images.plan(*Image.open(photo).size).grid
        sample = MeasuredSample(sample_id=f"{data}[{record}]", file=str(data), line=1,
                                input_ids=np.zeros(1, dtype=np.int64), is_answer=np.zeros(1, dtype=bool),
                                images=[str(photo)], image_grids=[grid], record=record)
        assert store.problem(sample) is None
        (row,), _ = store.rows(sample)
        found.append(row.order)
    assert found == [0, 1, 2] and len(store) == 3


def test_a_store_of_an_older_format_is_refused_in_one_line(encoded, tmp_path):
    """embeddings/1 found media by their sample's line, which records of a one-line JSON array share:
    such a store is refused, not misread."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "index.jsonl").write_bytes((encoded / "index.jsonl").read_bytes())
    encoder = json.loads((encoded / "encoder.json").read_text())
    (old / "encoder.json").write_text(json.dumps({**encoder, "format": "loongforge-embeddings/1"}))
    with pytest.raises(InputError) as refused:
        EmbeddingStore(old)
    assert str(refused.value) == (f"{old} was written by an older `loongforge encode` (loongforge-embeddings/1, not "
                                  "loongforge-embeddings/2: media found by line, which records of a JSON array can "
                                  "share); encode again with --overwrite")


def test_a_text_only_preset_is_a_usage_error(tmp_path):
    refused = _encode(tmp_path / "out", "--preset", "llm-tiny")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: --preset llm-tiny: model family llm has no vision encoder that runs on its own; encode runs a "
        "vision-language preset's encoder (see --list-presets)")
    assert not (tmp_path / "out").exists()


def test_help_says_what_the_default_bf16_store_costs_in_the_loss():
    """Issue 30, item 14: a bf16 store (the default) is not the online encoder's features."""
    from typer.testing import CliRunner

    from loongforge.cli.app import app

    result = CliRunner().invoke(app, ["encode", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "bf16 halves the store" in text and "about 1e-5 relative in the loss; fp32 matches it to about 1e-7" in text
