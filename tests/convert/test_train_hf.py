"""``loongforge train`` with HF weights: ``checkpoint.load_hf=DIR`` at start-up, ``checkpoint.save_hf=true``
at the end, and ``checkpoint.load=DST`` from a model-only checkpoint written by ``loongforge convert``."""

from __future__ import annotations

import json

import torch

from loongforge.config.loader import load_run_config
from loongforge.convert.engine import hf_to_mcore
from tests.convert.helpers import hub_state, save_hf_checkpoint
from tests.train.conftest import PRESET, SAVE_AT_END, SMALL_MODEL, assert_quiet_stderr, losses, run_train

FROZEN = ["training.train_steps=1", "optimizer.lr=0", "optimizer.min_lr=0", "optimizer.weight_decay=0"]


def test_load_hf_save_hf_and_load_converted(tmp_path):
    model_cfg = load_run_config(PRESET, overrides=SMALL_MODEL).model
    save_hf_checkpoint(tmp_path / "hf", model_cfg, style="new")

    # lr 0: the exported weights must be the loaded ones, bit for bit
    run_train(tmp_path / "run_hf", f"checkpoint.load_hf={tmp_path / 'hf'}", "checkpoint.save_hf=true", SAVE_AT_END,
              *FROZEN)
    exported, original = hub_state(tmp_path / "run_hf" / "hf"), hub_state(tmp_path / "hf")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert json.loads((tmp_path / "run_hf" / "hf" / "config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "config.json").read_text())
    # ready to serve: the source's generation defaults, the run's tokenizer and processor (the source has none)
    served = {path.name for path in (tmp_path / "run_hf" / "hf").iterdir()}
    assert {"generation_config.json", "tokenizer.json", "chat_template.jinja", "processor_config.json"} <= served
    processor = json.loads((tmp_path / "run_hf" / "hf" / "processor_config.json").read_text())
    data_cfg = load_run_config(PRESET, overrides=SMALL_MODEL).data
    assert processor["image_processor"]["size"]["longest_edge"] == data_cfg.max_pixels

    # the same weights through a converted checkpoint: same first loss, and the run starts at step 0
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    loaded = run_train(tmp_path / "run_mcore", f"checkpoint.load={tmp_path / 'mcore'}", *FROZEN)
    assert_quiet_stderr(loaded.stderr, "train checkpoint.load=")
    first_hf, first_mcore = losses(tmp_path / "run_hf"), losses(tmp_path / "run_mcore")
    assert len(first_mcore) == 1 and first_mcore == first_hf
