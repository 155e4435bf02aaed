"""The run's cost model: balance.* config, file vs checkpoint precedence, checkpoint state."""

from __future__ import annotations

import pytest

from loongforge.balance.cost_model import CostModel, token_count_model
from loongforge.config.errors import ConfigError
from loongforge.config.loader import load_run_config
from loongforge.train.balancing import EXTRA_KEY, RunBalancing


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
    keeper = RunBalancing(cfg.balance)
    assert keeper.cost_model is None and keeper.state_dict() == {}
    keeper.cost_model = _model("fit:online", 2e-4)
    extra = keeper.state_dict()
    assert set(extra) == {EXTRA_KEY}
    resumed = RunBalancing(cfg.balance)
    resumed.load_state_dict(extra)
    assert resumed.cost_model == keeper.cost_model


def test_an_explicit_cost_model_file_wins_over_the_checkpoint(tmp_path):
    path = tmp_path / "COST.json"
    _model("fit:nnls", 5e-4).save(path)
    cfg = load_run_config("qwen2.5vl-tiny", overrides=[f"balance.cost_model={path}"])
    keeper = RunBalancing(cfg.balance)
    keeper.load_state_dict({EXTRA_KEY: _model("fit:online", 1e-4).to_dict()})
    assert keeper.cost_model.source == "fit:nnls"
    assert keeper.cost_model.coefficients["sum_L"] == 5e-4


def test_every_model_change_is_a_new_version_the_pipeline_follows():
    cfg = load_run_config("qwen2.5vl-tiny")
    balancing = RunBalancing(cfg.balance)
    first = balancing.version
    balancing.load_state_dict({EXTRA_KEY: _model("fit:online", 1e-4).to_dict()})
    assert balancing.version == first + 1
    balancing.load_state_dict({})  # nothing saved: the model and its version stay
    assert balancing.version == first + 1


def test_without_an_encoder_the_planner_sees_no_vision_terms_but_the_checkpoint_keeps_them():
    """data.vision_embeddings: the encoder does not run, so a sample's images cost nothing more
    than their tokens; the fitted model itself is saved whole."""
    cfg = load_run_config("qwen2.5vl-tiny")
    balancing = RunBalancing(cfg.balance, prices_vision=False)
    model = _model("fit:nnls", 2e-4)
    model.coefficients.update(sum_P2=1e-9, sum_P=3e-6, n_img=1e-3)
    balancing.cost_model = model
    priced = balancing.cost_model.sample_costs([100, 100], [[], [1024, 256]])
    assert priced[0] == priced[1] == pytest.approx(100 * 2e-4)
    assert balancing.state_dict()[EXTRA_KEY]["coefficients"]["n_img"] == 1e-3
    with_encoder = RunBalancing(cfg.balance)
    with_encoder.cost_model = model
    costs = with_encoder.cost_model.sample_costs([100, 100], [[], [1024, 256]])
    assert costs[1] > costs[0]


def test_fit_warnings_stay_off_the_console_of_a_run_that_does_not_use_the_model(monkeypatch):
    """Issue 30, item 13: balancing off (the default run) printed "cost model warning: term ... was
    fitted to 0" about a model it does not use; the fit line stays (the model is saved for a later
    balanced run), its warnings only where the model prices something."""
    from types import SimpleNamespace

    import loongforge.train.balancing as balancing

    monkeypatch.setattr(balancing, "observations_from_records", lambda *args, **kwargs: None)
    cfg = load_run_config("qwen2.5vl-tiny")
    lines = {}
    for in_use in (True, False):
        logged = lines.setdefault(in_use, [])
        run = RunBalancing(cfg.balance, log=logged.append, model_in_use=in_use)
        run._fit_observations = lambda obs: SimpleNamespace(
            model=SimpleNamespace(source=None, environment=None), report={"held_out_micro_batch": {"median_ape_pct": 3.0}},
            warnings=["term n_img was fitted to 0: its effect is below the measurement noise"])
        run._fit(20)
    assert lines[True][0].count("\ncost model warning: term n_img was fitted to 0") == 1
    assert lines[False] == ["cost model: fitted online at step 20 from 0 records, held-out median error 3.0%"]
