"""data.source=packed: DataPipeline rows are the packs of a `loongforge pack` folder."""

from pathlib import Path

import numpy as np
import pytest
import torch

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.data.packfile import folder
from loongforge.data.pipeline import DataPipeline
from loongforge.pack.job import PackOptions, run_pack
from loongforge.pack.workers import MeasureContext, install, measure_index
from tests.pack.conftest import PRESET, SEQ_LEN


def _packed(pack_inputs, root):
    run_pack(PackOptions(inputs=tuple(pack_inputs), output=Path(root), preset=PRESET, seq_len=SEQ_LEN,
                         packs_per_shard=1, progress=False))
    return folder.read_lines(Path(root) / folder.MANIFEST_FILE)


def _pipeline(root, **data):
    overrides = [f"data.packed={root}", "data.source=packed", f"data.seq_len={SEQ_LEN}", "data.num_workers=0",
                 *(f"data.{k}={v}" for k, v in data.items())]
    cfg = load_run_config(PRESET, overrides=overrides)
    return cfg, DataPipeline(cfg.data, cfg.model, global_batch_size=1, dp_rank=0, dp_size=1, pad_to_multiple=8)


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
        got = 0 if mb["pixel_values"] is None else mb["pixel_values"].shape[0]
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
    (tmp_path / "packed" / folder.STATS_FILE).unlink()
    with pytest.raises(InputError, match="not a finished"):
        _pipeline(tmp_path / "packed")
