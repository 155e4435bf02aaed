"""data.source=packed: DataPipeline rows are the packs of a `loongforge pack` folder."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from loongforge.cli.app import app
from loongforge.config.errors import InputError
from loongforge.config.layout import sample_multiple
from loongforge.config.loader import load_run_config
from loongforge.data.packfile import folder
from loongforge.data.packing import padded_length
from loongforge.data.pipeline import DataPipeline
from loongforge.pack.job import PackOptions, run_pack
from loongforge.pack.workers import MeasureContext, install, measure_index
from tests.pack.conftest import PRESET, SEQ_LEN


def _packed(pack_inputs, root, seq_len=SEQ_LEN):
    run_pack(PackOptions(inputs=tuple(pack_inputs), output=Path(root), preset=PRESET, seq_len=seq_len,
                         packs_per_shard=1, progress=False))
    return folder.read_lines(Path(root) / folder.MANIFEST_FILE)


def _pipeline(root, context_parallel=1, seq_len=SEQ_LEN, **data):
    """The training pipeline of one data-parallel rank; at CP > 1 its samples padded as the runner pads them."""
    overrides = [f"data.packed={root}", "data.source=packed", f"data.seq_len={seq_len}", "data.num_workers=0",
                 f"parallel.context_parallel_size={context_parallel}", f"parallel.world_size={context_parallel}",
                 *(f"data.{k}={v}" for k, v in data.items())]
    cfg = load_run_config(PRESET, overrides=overrides)
    return cfg, DataPipeline(cfg.data, cfg.model, global_batch_size=1, dp_rank=0, dp_size=1, pad_to_multiple=8,
                             sample_multiple=sample_multiple(cfg.data, cfg.parallel))


def test_rows_are_the_packs(pack_inputs, tmp_path):
    manifest = _packed(pack_inputs, tmp_path / "packed")
    cfg, pipeline = _pipeline(tmp_path / "packed", shuffle="false")
    context = MeasureContext(inputs=tuple(pack_inputs), data_cfg=cfg.data, model_cfg=cfg.model)
    install(context)
    for pack in manifest:
        (mb,) = pipeline.next_step()
        assert mb["sample_ids"] == [s["id"] for s in pack["samples"]]
        assert mb["sample_lengths"] == [s["tokens"] for s in pack["samples"]]
        cu = mb["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[-1] == mb["input_ids"].shape[1]
        assert (cu[1:len(pack["samples"]) + 1] - cu[:len(pack["samples"])]).tolist() == mb["sample_lengths"]
        expected_ids = np.concatenate([measure_index(s["index"]).input_ids for s in pack["samples"]])
        assert torch.equal(mb["input_ids"][0, :len(expected_ids)], torch.from_numpy(expected_ids))
        image_patches = sum(sum(s["patches"][: s["images"]]) for s in pack["samples"])
        got = 0 if mb["media"].images is None else mb["media"].images.rows.shape[0]
        assert got == image_patches
    (again,) = pipeline.next_step()  # the next epoch starts over
    assert again["sample_ids"] == [s["id"] for s in manifest[0]["samples"]]


def test_resume_mid_epoch(pack_inputs, tmp_path):
    _packed(pack_inputs, tmp_path / "packed")
    _, first = _pipeline(tmp_path / "packed")
    first.next_step()
    state = first.state_dict()
    expected = first.next_step()[0]["sample_ids"]
    _, resumed = _pipeline(tmp_path / "packed")
    resumed.load_state_dict(state)
    assert resumed.next_step()[0]["sample_ids"] == expected


def test_incompatible_or_unfinished_folders_are_refused(pack_inputs, tmp_path):
    _packed(pack_inputs, tmp_path / "packed")
    with pytest.raises(InputError, match="seq_len"):
        _pipeline(tmp_path / "packed", seq_len=SEQ_LEN // 2)
    with pytest.raises(InputError, match="other rules"):
        _pipeline(tmp_path / "packed", max_pixels=28 * 28 * 16)
    # A folder of an older format named samples by line: refused in one line, not misread.
    stats = tmp_path / "packed" / folder.STATS_FILE
    stats.write_text(json.dumps({**json.loads(stats.read_text()), "format": "loongforge-pack/1"}))
    with pytest.raises(InputError, match=r"written by an older `loongforge pack` \(loongforge-pack/1, not "
                                         r"loongforge-pack/2: samples named by line"):
        _pipeline(tmp_path / "packed")
    (tmp_path / "packed" / folder.STATS_FILE).unlink()
    with pytest.raises(InputError, match="not a finished"):
        _pipeline(tmp_path / "packed")


def test_packed_for_context_parallel_trains_at_cp2_and_a_plain_folder_is_refused(pack_inputs, tmp_path):
    """`loongforge pack --context-parallel 2` counts every sample at its length rounded up to a
    multiple of 4, so each pack still fits seq_len once training pads it (packed without the flag,
    a 512-token pack of these samples takes 520 padded); stats record the 4. A CP 2 pipeline reads
    it, and refuses the folder packed without the flag in one line naming the flag."""
    seq_len = 512
    root = tmp_path / "cp2"
    result = CliRunner().invoke(app, ["pack", *pack_inputs, "--output", str(root), "--preset", PRESET,
                                      "--seq-len", str(seq_len), "--context-parallel", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "samples padded to a multiple of 4" in result.output
    stats = json.loads((root / folder.STATS_FILE).read_text())
    assert stats["sample_multiple"] == 4
    manifest = folder.read_lines(root / folder.MANIFEST_FILE)
    plain = _packed(pack_inputs, tmp_path / "plain", seq_len=seq_len)

    def footprints(packs):
        return [sum(padded_length(s["tokens"], 4) for s in pack["samples"]) for pack in packs]

    print(f"padded pack sizes, --context-parallel 2: {footprints(manifest)}; without: {footprints(plain)} "
          f"(of {seq_len})")
    assert max(footprints(manifest)) <= seq_len < max(footprints(plain))
    lengths = [s["tokens"] for pack in manifest for s in pack["samples"]]
    assert len(manifest) == stats["packs"] and sum(lengths) == stats["tokens_packed"] and any(n % 4 for n in lengths)

    _, pipeline = _pipeline(root, context_parallel=2, seq_len=seq_len, shuffle="false")
    for pack in manifest:
        (mb,) = pipeline.next_step()
        assert mb["sample_lengths"] == [s["tokens"] for s in pack["samples"]]
        segments = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()[:len(pack["samples"])]
        assert segments == [padded_length(s["tokens"], 4) for s in pack["samples"]]
        assert mb["input_ids"].shape[1] <= seq_len

    assert json.loads((tmp_path / "plain" / folder.STATS_FILE).read_text())["sample_multiple"] == 1
    with pytest.raises(InputError) as refused:
        _pipeline(tmp_path / "plain", context_parallel=2, seq_len=seq_len)
    message = str(refused.value)
    assert "\n" not in message and message.endswith("repack with --context-parallel 2"), message
    assert "padded to a multiple of 1, but parallel.context_parallel_size needs 4" in message
    with pytest.raises(InputError, match="other inputs or flags"):  # a resume keeps the padding
        run_pack(PackOptions(inputs=tuple(pack_inputs), output=root, preset=PRESET, seq_len=seq_len, resume=True,
                             progress=False))
