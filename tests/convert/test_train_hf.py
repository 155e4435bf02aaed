"""``loongforge train`` with HF weights: ``checkpoint.load_hf=DIR`` at start-up (the folder's config.json
decides the architecture), ``checkpoint.save_hf=true`` at the end, and ``checkpoint.load=DST`` from a
model-only checkpoint written by ``loongforge convert``."""

from __future__ import annotations

import json

import pytest
import torch

from loongforge.config.loader import load_resolved_config, load_run_config
from loongforge.convert.engine import hf_to_mcore
from tests.convert.helpers import hub_state, save_hf_checkpoint
from tests.train.conftest import (
    PRESET,
    SAVE_AT_END,
    SMALL_MODEL,
    assert_quiet_stderr,
    losses,
    random_hf_folder,
    run_train,
)

FROZEN = ["training.train_steps=1", "optimizer.lr=0", "optimizer.min_lr=0", "optimizer.weight_decay=0"]
# The tests' small run, without its model settings: the folder says what the model is.
RUN = [option for option in SMALL_MODEL if not option.startswith("model.")]
# A Qwen2.5-VL the preset is not: other widths and depths, rope theta, vision window, full-attention
# block and head tying (the preset: 4 layers of 128 (384), theta 1e6, window 112, block 1, tied).
OTHER_MODEL = ["model.language.num_layers=3", "model.language.ffn_hidden_size=256", "model.vision.depth=3",
               "model.vision.intermediate_size=96", "model.language.rope_theta=10000.0", "model.vision.window.size=56",
               "model.vision.window.fullatt_block_indexes=[2]", "model.language.tie_word_embeddings=false"]


def test_load_hf_save_hf_and_load_converted(tmp_path):
    model_cfg = load_run_config(PRESET, overrides=OTHER_MODEL).model
    save_hf_checkpoint(tmp_path / "hf", model_cfg, style="new")

    # lr 0: the exported weights must be the loaded ones, bit for bit, and the model the folder's
    proc = run_train(tmp_path / "run_hf", f"checkpoint.load_hf={tmp_path / 'hf'}", "checkpoint.save_hf=true",
                     SAVE_AT_END, *FROZEN, options=RUN)
    said = [line for line in proc.stderr.splitlines() if line.startswith("model: the architecture of")]
    print(said[0])
    assert "model.language.rope_theta 1000000.0 -> 10000.0" in said[0] and "model.vision.window.size 112 -> 56" in said[0]
    assert load_resolved_config(tmp_path / "run_hf" / "config.yaml").model == model_cfg
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
    loaded = run_train(tmp_path / "run_mcore", f"checkpoint.load={tmp_path / 'mcore'}", *FROZEN, *OTHER_MODEL,
                       options=RUN)
    assert_quiet_stderr(loaded.stderr, "train checkpoint.load=")
    first_hf, first_mcore = losses(tmp_path / "run_hf"), losses(tmp_path / "run_mcore")
    assert len(first_mcore) == 1 and first_mcore == first_hf


def test_a_model_setting_that_contradicts_the_folder_stops(tmp_path):
    save_hf_checkpoint(tmp_path / "hf", load_run_config(PRESET, overrides=OTHER_MODEL).model, style="new")
    proc = run_train(tmp_path / "run", f"checkpoint.load_hf={tmp_path / 'hf'}", "model.language.rope_theta=500000",
                     options=RUN, expect_ok=False)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if "rope_theta" in line]
    print(line)
    assert f"model.language.rope_theta=500000.0 contradicts {tmp_path / 'hf' / 'config.json'} (10000.0)" in line


# An LLM and a MoE LLM the presets are not: depth, widths, rope theta, head tying (and experts).
OTHER_LLMS = {
    "llm-tiny-small-vocab": ["model.language.num_layers=3", "model.language.ffn_hidden_size=256",
                             "model.language.rope_theta=10000.0", "model.language.tie_word_embeddings=false"],
    "qwen3-moe-tiny-small-vocab": ["model.language.num_layers=3", "model.language.moe.num_experts=4",
                                   "model.language.moe.ffn_hidden_size=32", "model.language.rope_theta=10000.0",
                                   "model.language.tie_word_embeddings=false"],
}


@pytest.mark.parametrize("preset", sorted(OTHER_LLMS))
def test_an_llm_folder_decides_the_model_and_exports_back_unchanged(preset, tmp_path):
    random_hf_folder(preset, OTHER_LLMS[preset], tmp_path / "hf")
    run_train(tmp_path / "run", f"checkpoint.load_hf={tmp_path / 'hf'}", "checkpoint.save_hf=true", SAVE_AT_END,
              *FROZEN, options=RUN, preset=preset)
    exported, original = hub_state(tmp_path / "run" / "hf"), hub_state(tmp_path / "hf")
    different = sorted(k for k in original if k not in exported or not torch.equal(exported[k], original[k]))
    written, read = (json.loads((folder / "config.json").read_text()) for folder in (tmp_path / "run" / "hf", tmp_path / "hf"))
    fields = sorted(k for k in read if written.get(k) != read[k] and k != "transformers_version")
    print(f"{preset} from a folder of another model: {len(different)} of {len(original)} tensors and "
          f"{len(fields)} config.json fields differ after 1 step at lr 0 ({fields})")
    assert not different and exported.keys() == original.keys() and not fields
