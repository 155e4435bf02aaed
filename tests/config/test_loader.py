"""Composition, config files, overrides and deletion."""

from __future__ import annotations

import pytest

from loongforge.config.errors import ConfigError
from loongforge.config.loader import compose_tree, load_run_config
from loongforge.config.presets import compose_preset
from loongforge.config.schema import RunConfig


def test_components_merge_in_order_then_own_keys(tmp_path, monkeypatch):
    (tmp_path / "components").mkdir()
    (tmp_path / "components" / "a.yaml").write_text("training:\n  train_steps: 1\n  seed: 5\n")
    (tmp_path / "components" / "b.yaml").write_text(
        "components: [components/a]\ntraining:\n  train_steps: 2\n")
    (tmp_path / "p.yaml").write_text("description: x\ncomponents:\n  - components/b.yaml\n"
                                     "optimizer:\n  lr: 1e-4\n")
    monkeypatch.setenv("LOONGFORGE_PRESETS", str(tmp_path))
    tree = compose_preset("p")
    assert tree == {"training": {"train_steps": 2, "seed": 5}, "optimizer": {"lr": 1e-4},
                    "preset": "p"}


def test_component_cycle_is_reported(tmp_path, monkeypatch):
    (tmp_path / "p.yaml").write_text("components: [q]\n")
    (tmp_path / "q.yaml").write_text("components: [p]\n")
    monkeypatch.setenv("LOONGFORGE_PRESETS", str(tmp_path))
    with pytest.raises(ConfigError, match="cycle"):
        compose_preset("p")


def test_user_config_file_goes_on_top_of_preset(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("training:\n  train_steps: 3\noptimizer:\n  lr: 2e-3\n")
    cfg = load_run_config("qwen2.5vl-tiny", config_file=path)
    assert cfg.training.train_steps == 3
    assert cfg.optimizer.lr == 2e-3  # `2e-3` without a dot is a float, not YAML 1.1's string
    assert cfg.training.global_batch_size == 4  # untouched preset key


def test_overrides_beat_config_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("training:\n  train_steps: 3\n")
    cfg = load_run_config("qwen2.5vl-tiny", config_file=path, overrides=["training.train_steps=9"])
    assert cfg.training.train_steps == 9


def test_override_values_parse_as_yaml():
    cfg = load_run_config("qwen2.5vl-tiny", overrides=[
        "optimizer.lr=3e-4", "training.freeze_vision=true", "checkpoint.load=null",
        "data.system_prompt=Be brief.", "optimizer.weight_decay=0"])
    assert cfg.optimizer.lr == 3e-4
    assert cfg.training.freeze_vision is True
    assert cfg.checkpoint.load is None
    assert cfg.data.system_prompt == "Be brief."
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)


def test_override_nested_lists_whole_and_by_index():
    cfg = load_run_config("qwen2.5vl-tiny", overrides=[
        "model.language.mrope_section=[4, 4, 8]", "model.vision.window.fullatt_block_indexes=[0,1]",
        "data.source=files", "data.paths=[a.jsonl, b.jsonl]", "data.paths.1=c.jsonl"])
    assert cfg.model.language.mrope_section == [4, 4, 8]
    assert cfg.model.vision.window.fullatt_block_indexes == [0, 1]
    assert cfg.data.paths == ["a.jsonl", "c.jsonl"]


def test_tilde_deletes_key_back_to_schema_default():
    schema = RunConfig()
    cfg = load_run_config("qwen2.5vl-tiny", overrides=[
        "~training.train_steps", "~model.language", "~model.projector.out_hidden_size"])
    assert cfg.training.train_steps == schema.training.train_steps
    assert cfg.model.language == schema.model.language
    # The preset's other keys stay.
    assert cfg.training.global_batch_size == 4


def test_tilde_then_set_applies_left_to_right():
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["~optimizer.lr", "optimizer.lr=5e-4"])
    assert cfg.optimizer.lr == 5e-4


def test_tilde_unknown_key_suggests_the_real_one():
    with pytest.raises(ConfigError, match=r"did you mean 'optimizer\.min_lr'"):
        compose_tree("qwen2.5vl-tiny", overrides=["~optimizer.min_lrr"])


def test_malformed_overrides_are_all_reported():
    with pytest.raises(ConfigError) as info:
        compose_tree("qwen2.5vl-tiny", overrides=["notanoverride", "a..b=1", "~x=1"])
    assert len(info.value.messages) == 3


def test_override_into_a_scalar_says_it_is_not_a_section():
    with pytest.raises(ConfigError, match="'training.train_steps' holds the value 150"):
        compose_tree("qwen2.5vl-tiny", overrides=["training.train_steps.x=1"])


def test_world_size_argument_replaces_config_world_size():
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    assert cfg.parallel.world_size == 2


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  train_steps: 3\n  seed: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_run_config("qwen2.5vl-tiny", config_file=path)
    (message,) = info.value.messages
    assert message.startswith(f"{path}:4:1: YAML syntax error")


def test_yaml_syntax_error_line_and_column_point_at_the_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer:\n  lr: 1e-4\n   min_lr: 1e-5\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:\d+: YAML syntax error"):
        load_run_config("qwen2.5vl-tiny", config_file=path)


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("training:\n  train_steps: 3\n  train_steps: 4\n")
    with pytest.raises(ConfigError, match=rf"{path}:3:3: .*duplicate key 'train_steps'"):
        load_run_config("qwen2.5vl-tiny", config_file=path)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_run_config("qwen2.5vl-tiny", config_file=tmp_path / "nope.yaml")


def test_unknown_preset_lists_presets_with_did_you_mean():
    with pytest.raises(ConfigError) as info:
        load_run_config("qwen2.5vl-7")
    (message,) = info.value.messages
    assert "unknown preset 'qwen2.5vl-7'" in message
    assert "did you mean 'qwen2.5vl-7b'?" in message
    assert "qwen2.5vl-72b" in message and "qwen2.5vl-tiny" in message
