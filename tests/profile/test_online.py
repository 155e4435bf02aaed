"""The run's cost model: balance.* config, file vs checkpoint precedence, checkpoint state."""

from __future__ import annotations

import pytest

from loongforge.balance.cost_model import CostModel, token_count_model
from loongforge.config.errors import ConfigError
from loongforge.config.loader import load_run_config
from loongforge.profile.online import EXTRA_KEY, CostModelKeeper, training_observer
from loongforge.profile.recorder import TrainingObserver


def _model(source: str, b: float) -> CostModel:
    model = token_count_model()
    model.coefficients["sum_L"] = b
    model.source = source
    return model


def test_balance_config_is_validated_with_the_key_named(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_run_config("qwen2.5vl-tiny", overrides=[f"balance.cost_model={tmp_path / 'none.json'}",
                                                      "balance.fit_steps=-1"])
    messages = " ".join(info.value.messages)
    assert "balance.fit_steps=-1 must not be negative" in messages
    with pytest.raises(ConfigError, match="balance.cost_model=.*is not a file"):
        load_run_config("qwen2.5vl-tiny", overrides=[f"balance.cost_model={tmp_path / 'none.json'}"])
    with pytest.raises(ConfigError, match="balance.refit_interval=5 needs balance.fit_steps > 0"):
        load_run_config("qwen2.5vl-tiny", overrides=["balance.fit_steps=0", "balance.refit_interval=5"])


def test_checkpoint_state_round_trips_and_restores_the_model():
    cfg = load_run_config("qwen2.5vl-tiny")
    keeper = CostModelKeeper(cfg.balance)
    assert keeper.cost_model is None and keeper.state_dict() == {}
    keeper.cost_model = _model("fit:online", 2e-4)
    extra = keeper.state_dict()
    assert set(extra) == {EXTRA_KEY}
    resumed = CostModelKeeper(cfg.balance)
    resumed.load_state_dict(extra)
    assert resumed.cost_model == keeper.cost_model


def test_an_explicit_cost_model_file_wins_over_the_checkpoint(tmp_path):
    path = tmp_path / "COST.json"
    _model("fit:nnls", 5e-4).save(path)
    cfg = load_run_config("qwen2.5vl-tiny", overrides=[f"balance.cost_model={path}"])
    keeper = CostModelKeeper(cfg.balance)
    keeper.load_state_dict({EXTRA_KEY: _model("fit:online", 1e-4).to_dict()})
    assert keeper.cost_model.source == "fit:nnls"
    assert keeper.cost_model.coefficients["sum_L"] == 5e-4


def test_profile_observer_replaces_the_keeper():
    cfg = load_run_config("qwen2.5vl-tiny")
    mine = TrainingObserver()
    assert training_observer(cfg, mine) is mine
    assert isinstance(training_observer(cfg), CostModelKeeper)
