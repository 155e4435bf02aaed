"""``convert.hf_architecture``: an HF folder's config.json decides the model a run builds
(``train checkpoint.load_hf``, ``encode --hf``); the preset fills in what config.json cannot say.
The end-to-end proofs (a folder of another model trains as itself and exports back bit-identical)
are tests/convert/test_train_hf.py."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.convert.hf_architecture import model_from_hf_folder
from loongforge.encode.job import EncodeOptions, _model_of_weights
from loongforge.models.registry import get_family


def _folder(tmp_path, preset: str, overrides: list[str]):
    model_cfg = load_run_config(preset, overrides=overrides).model
    folder = tmp_path / preset
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(get_family(model_cfg.family).config_to_hf(model_cfg)))
    save_file({}, str(folder / "model.safetensors"))
    return folder, model_cfg


def test_the_folder_decides_and_the_preset_fills_in_what_it_cannot_say(tmp_path):
    # DeepSeek-V3's tiny preset speaks Qwen3's chat format, which config.json has no field for.
    folder, expected = _folder(tmp_path, "deepseek-v3-tiny", ["model.language.num_layers=3",
                                                              "model.language.rope_theta=50000.0"])
    cfg = load_run_config("deepseek-v3-tiny", overrides=[f"checkpoint.load_hf={folder}", "model.chat_format=chatml"])
    built, changes = model_from_hf_folder(cfg, folder, ["model.chat_format"])
    print(changes)
    assert built.model.chat_format == "chatml" and built.model.language == expected.language
    assert changes == ["model.language.num_layers 4 -> 3", "model.language.rope_theta 10000.0 -> 50000.0"]


def test_what_contradicts_the_folder_stops_in_one_line(tmp_path):
    folder, _ = _folder(tmp_path, "llm-tiny", ["model.language.num_layers=3"])
    cfg = load_run_config("llm-tiny", overrides=["model.language.num_layers=5"])
    with pytest.raises(InputError, match=r"model.language.num_layers=5 contradicts .*config.json \(3\)"):
        model_from_hf_folder(cfg, folder, ["model.language.num_layers"])
    # an explicit setting that agrees is no contradiction
    agreed = load_run_config("llm-tiny", overrides=["model.language.num_layers=3"])
    assert model_from_hf_folder(agreed, folder, ["model.language.num_layers"])[0].model.language.num_layers == 3
    with pytest.raises(InputError, match=r"describes a model of model.family=llm .* this run's is model.family=qwen2_5_vl"):
        model_from_hf_folder(load_run_config("qwen2.5vl-tiny"), folder, [])
    with pytest.raises(InputError, match=r"--hf=.*: no config.json there"):
        model_from_hf_folder(cfg, tmp_path, [], setting="--hf")


def test_encode_builds_the_tower_of_its_hf_folder(tmp_path):
    folder, expected = _folder(tmp_path, "qwen2.5vl-tiny", ["model.vision.window.size=56",
                                                            "model.vision.window.fullatt_block_indexes=[0]"])
    options = EncodeOptions(inputs=(), output=tmp_path / "out", preset="qwen2.5vl-tiny", weights=str(folder))
    cfg = _model_of_weights(load_run_config("qwen2.5vl-tiny"), options)
    assert cfg.model.vision == expected.vision and cfg.model.vision.window.size == 56
