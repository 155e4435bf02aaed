"""checkpoint.weights_only refusals, each one line before anything loads (the stage itself trains in
tests/train/test_validation_train.py::test_a_new_stage_starts_from_the_weights_alone)."""

from __future__ import annotations

import json

import pytest

from loongforge.config.errors import InputError
from loongforge.train.checkpoint import load_weights_only
from tests.config.test_validate import errors_for


def test_a_lora_checkpoint_is_not_a_stage_start(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"step": 5, "lora_base": {"kind": "seed", "seed": 1, "rank": 8}}))
    with pytest.raises(InputError, match=r"holds LoRA adapters alone.*checkpoint.load_hf=DIR"):
        load_weights_only(tmp_path, [], None)
    with pytest.raises(InputError, match="no meta.json"):
        load_weights_only(tmp_path / "missing", [], None)


@pytest.mark.parametrize("overrides, message", [
    (("checkpoint.weights_only=true",), "checkpoint.weights_only=true starts a new stage from checkpoint.load"),
    (("checkpoint.weights_only=true", "checkpoint.load=/x", "lora.rank=8"), "a LoRA stage takes its frozen base"),
    (("training.freeze_language=true", "training.freeze_vision=true", "training.freeze_projector=true"),
     "training.freeze_language=true leaves nothing to train"),
    (("training.freeze_language=true", "lora.rank=8"), "LoRA freezes the whole base already"),
])
def test_bad_stage_settings_name_the_key(overrides, message):
    errors = errors_for(*overrides)
    assert len(errors) == 1 and message in errors[0], errors
