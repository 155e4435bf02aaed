"""Fitting the cost model: recovery of known coefficients, identifiability, bad input, COST.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loongforge.balance.cost_model import TERMS, CostModel, SampleCost, batch_features
from loongforge.balance.fit import (
    FitError,
    Observations,
    check_identifiable,
    fit_nnls,
    fit_smoothmax,
    split_by_step,
)
from loongforge.config.errors import InputError
from loongforge.profile.profile_file import PROFILE_FORMAT, read_profile
from tests.console import assert_no_third_party_warning, console_of

# Every term carries a few percent of a typical micro-batch, so each is measurable.
TRUE = dict(sum_L2=2e-8, sum_L=1e-4, N=5e-2, sum_P2=2e-7, sum_P=1e-4, n_img=5e-2, n_loss=1e-4)
OVERHEAD_S = 0.05


def synthetic(*, steps=60, ranks=4, micro_batches=2, noise=0.002, seed=0, images=True,
              lengths=None) -> Observations:
    """Micro-batches of random packed samples timed by the TRUE model with relative noise."""
    rng = np.random.default_rng(seed)
    feats, step_ids, rank_ids = [], [], []
    for step in range(steps):
        for rank in range(ranks):
            for _ in range(micro_batches):
                samples = []
                for _ in range(int(rng.integers(1, 6))):
                    L = int(rng.integers(64, 4096)) if lengths is None else int(rng.choice(lengths))
                    patches = tuple(int(p) for p in rng.integers(16, 1600, size=rng.integers(0, 4))) if images else ()
                    samples.append(SampleCost(L, patches, loss_tokens=int(L * rng.uniform(0.05, 0.9))))
                feats.append(batch_features(samples))
                step_ids.append(step), rank_ids.append(rank)
    F = np.array(feats)
    t = (F @ np.array([TRUE[k] for k in TERMS]) + OVERHEAD_S) * (1 + noise * rng.standard_normal(len(F)))
    step_ids, rank_ids = np.array(step_ids), np.array(rank_ids)
    step_seconds = {s: {r: float(t[(step_ids == s) & (rank_ids == r)].sum()) + 0.05
                        for r in range(ranks)} for s in range(steps)}
    return Observations(F, t, step_ids, rank_ids, step_seconds)


def test_nnls_recovers_known_coefficients_within_half_a_percent():
    # The figures docs/benchmarks/cost_model.md quotes from this test: with 0.2% timing noise
    # (2,000 micro-batches) every coefficient within 0.5%, held-out median error 0.16%.
    result = fit_nnls(synthetic(steps=250, noise=0.002))
    for term, true in TRUE.items():
        assert result.model.coefficients[term] == pytest.approx(true, rel=0.005), term
    assert result.model.micro_batch_overhead_s == pytest.approx(OVERHEAD_S, rel=0.005)
    held = result.report["held_out_micro_batch"]
    assert held["median_ape_pct"] <= 0.16 and held["r2"] > 0.999
    assert result.warnings == []
    assert sum(result.report["term_shares"].values()) == pytest.approx(1.0)


def test_nnls_predicts_step_time_better_than_smoothmax_with_per_rank_data():
    obs = synthetic(noise=0.01)
    nnls, smooth = fit_nnls(obs), fit_smoothmax(obs)
    assert nnls.report["step_time"]["median_ape_pct"] < smooth.report["step_time"]["median_ape_pct"] + 1.0
    assert all(v >= 0 for v in smooth.model.coefficients.values())
    assert smooth.report["step_time"]["count"] == nnls.report["step_time"]["count"] > 0


def test_split_by_step_never_splits_a_step():
    steps = np.repeat(np.arange(20), 8)
    is_train = split_by_step(steps)
    for s in range(20):
        assert len(set(is_train[steps == s])) == 1
    assert 0 < (~is_train).sum() < len(steps)


def test_one_sample_length_is_rank_deficient_and_names_the_terms():
    obs = synthetic(lengths=[1024], images=False)
    with pytest.raises(FitError) as info:
        fit_nnls(obs)
    message = str(info.value)
    assert "rank-deficient" in message and "sum_L2" in message and "sum_L" in message
    assert "--sweep" in message


def test_text_only_profile_warns_which_terms_are_not_fitted():
    result = fit_nnls(synthetic(images=False))
    for term in ("sum_P2", "sum_P", "n_img"):
        assert result.model.coefficients[term] == 0.0
        assert any(term in w and "cannot be fitted" in w for w in result.warnings), result.warnings
    assert result.report["not_identified"] == ["sum_P2", "sum_P", "n_img"]
    assert result.model.coefficients["sum_L2"] == pytest.approx(TRUE["sum_L2"], rel=0.02)


def test_collinear_image_terms_are_named():
    F = np.array([batch_features([SampleCost(L, (256,) * k)]) for L in (100, 500, 900, 2000) for k in (1, 2, 3)] * 3)
    ident_error = None
    try:
        check_identifiable(F, intercept=True)
    except FitError as exc:
        ident_error = str(exc)
    assert ident_error is not None and "sum_P2" in ident_error and "n_img" in ident_error


@pytest.mark.parametrize("bad", [-0.1, float("nan")])
def test_negative_or_nan_times_are_rejected(bad):
    obs = synthetic(steps=4)
    seconds = obs.seconds.copy()
    seconds[3] = bad
    with pytest.raises(FitError, match="negative or NaN"):
        Observations(obs.features, seconds, obs.step, obs.rank)


def test_empty_observations_are_rejected():
    with pytest.raises(FitError, match="no observations"):
        Observations(np.zeros((0, len(TERMS))), np.zeros(0), np.zeros(0), np.zeros(0))


def _env(**extra):
    return {"kind": "env", "format": PROFILE_FORMAT, "device": "cpu", "dtype": "fp32",
            "preset": "test", "model": {"size": 1}, **extra}


def _mb(step, forward_s):
    return {"kind": "micro_batch", "step": step, "rank": 0, "warmup": False, "micro_batch": 0,
            "features": dict.fromkeys(TERMS, 1.0), "forward_s": forward_s, "backward_s": 0.1}


def test_read_profile_rejects_negative_nan_empty_and_mismatched(tmp_path):
    def write(name, *records):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    with pytest.raises(InputError, match=r"bad\.jsonl:3: forward_s=-1"):
        read_profile([write("bad.jsonl", _env(), _mb(1, 0.1), _mb(2, -1))])
    with pytest.raises(InputError, match="forward_s=nan"):
        read_profile([write("nan.jsonl", _env(), {**_mb(1, 0.1), "forward_s": float("nan")})])
    with pytest.raises(InputError, match="no micro_batch records"):
        read_profile([write("empty.jsonl", _env())])
    good = write("good.jsonl", _env(), _mb(1, 0.1))
    other = write("other.jsonl", _env(dtype="bf16"), _mb(1, 0.1))
    with pytest.raises(InputError, match="dtype differ"):
        read_profile([good, other])
    assert len(read_profile([good, good]).micro_batches) == 2


def test_cost_json_round_trips(tmp_path):
    result = fit_nnls(synthetic(steps=12))
    model = result.model
    model.environment = {"device": "cpu", "preset": "test"}
    path = tmp_path / "COST.json"
    model.save(path)
    loaded = CostModel.load(path)
    assert loaded == model
    assert loaded.micro_batch_overhead_s == model.micro_batch_overhead_s > 0
    assert json.loads(path.read_text())["terms"].keys() == set(TERMS)
    features = np.array([batch_features([SampleCost(700, (256,))])])
    assert loaded.predict_micro_batch(features) == pytest.approx(model.predict_micro_batch(features))


def test_one_answer_share_leaves_the_loss_term_unidentifiable_and_says_so():
    obs = synthetic(steps=20)
    obs.features[:, TERMS.index("n_loss")] = obs.features[:, TERMS.index("sum_L")] * 0.25
    with pytest.raises(FitError) as error:
        fit_nnls(obs)
    assert "n_loss" in str(error.value) and "answer (loss) shares differ" in str(error.value)
    assert fit_nnls(obs, exclude=["n_loss"]).model.coefficients["n_loss"] == 0.0


def test_cost_json_without_the_loss_term_reads_as_zero_and_pricing_needs_loss_counts(tmp_path):
    data = fit_nnls(synthetic(steps=12)).model.to_dict()
    assert data["coefficients"]["n_loss"] > 0
    with pytest.raises(ValueError, match="loss-token count"):
        CostModel.from_dict(data).sample_costs([100], [()])
    assert CostModel.from_dict(data).sample_costs([100], [()], [40])[0] > 0
    del data["coefficients"]["n_loss"]  # a COST.json written before the term existed
    old = CostModel.from_dict(data)
    assert old.coefficients["n_loss"] == 0.0
    assert old.sample_costs([100], [()])[0] > 0


def _write_profile(path, obs: Observations) -> None:
    records = [_env()]
    for i, (f, t, s, r) in enumerate(zip(obs.features, obs.seconds, obs.step, obs.rank)):
        records.append({"kind": "micro_batch", "step": int(s), "rank": int(r), "warmup": bool(s == 0),
                        "micro_batch": i, "features": dict(zip(TERMS, map(float, f))),
                        "forward_s": float(t) / 3, "backward_s": float(t) * 2 / 3})
    for s, per_rank in obs.step_seconds.items():
        records += [{"kind": "step", "step": int(s), "rank": r, "warmup": bool(s == 0), "step_s": v + 0.1,
                     "fwd_bwd_s": v}
                    for r, v in per_rank.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_fit_cost_command_writes_cost_json_with_accuracy_and_plot(tmp_path, capfd):
    from typer.testing import CliRunner

    from loongforge.cli.app import app

    profile = tmp_path / "PROFILE.jsonl"
    _write_profile(profile, synthetic(steps=40))
    out, fig = tmp_path / "COST.json", tmp_path / "fit.png"
    result, stderr = console_of(capfd, lambda: CliRunner().invoke(
        app, ["fit-cost", str(profile), "--output", str(out), "--plot", str(fig)]))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "fit-cost --plot")
    assert "nnls:" in result.output and "smoothmax:" in result.output
    model = CostModel.load(out)
    assert model.source == "fit:nnls"
    assert model.coefficients["sum_L2"] == pytest.approx(TRUE["sum_L2"], rel=0.05)
    assert model.accuracy["held_out_micro_batch"]["median_ape_pct"] < 1.0
    assert set(model.accuracy["comparison"]) == {"nnls", "smoothmax"}
    assert model.environment["device"] == "cpu" and model.environment["profiles"] == [str(profile)]
    assert fig.stat().st_size > 10_000


def test_fit_cost_check_reports_an_existing_models_accuracy_on_another_profile(tmp_path):
    from typer.testing import CliRunner

    from loongforge.cli.app import app

    fitted_on, checked_on = tmp_path / "A.jsonl", tmp_path / "B.jsonl"
    _write_profile(fitted_on, synthetic(steps=40, seed=1))
    _write_profile(checked_on, synthetic(steps=20, seed=2))
    cost = tmp_path / "COST.json"
    assert CliRunner().invoke(app, ["fit-cost", str(fitted_on), "--output", str(cost)]).exit_code == 0
    result = CliRunner().invoke(app, ["fit-cost", str(checked_on), "--check", str(cost)])
    assert result.exit_code == 0, result.output
    median = float(result.output.split("median error ")[1].split("%")[0])
    assert median < 1.0 and "measured/predicted median 1.0" in result.output
    # A model that is off by 2x says so.
    doubled = CostModel.load(cost)
    doubled.coefficients = {k: 2 * v for k, v in doubled.coefficients.items()}
    doubled.micro_batch_overhead_s *= 2
    doubled.save(tmp_path / "double.json")
    result = CliRunner().invoke(app, ["fit-cost", str(checked_on), "--check", str(tmp_path / "double.json")])
    assert "measured/predicted median 0.50" in result.output
    bad = CliRunner().invoke(app, ["fit-cost", str(checked_on), "--check", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and bad.output.startswith("error: --check:")


def test_fit_cost_command_reports_rank_deficiency_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from loongforge.cli.app import app

    profile = tmp_path / "PROFILE.jsonl"
    _write_profile(profile, synthetic(steps=10, lengths=[512], images=False))
    result = CliRunner().invoke(app, ["fit-cost", str(profile), "--output", str(tmp_path / "C.json")])
    assert result.exit_code == 2
    assert result.output.startswith("error: rank-deficient profile") and "sum_L2" in result.output
    assert not (tmp_path / "C.json").exists()


def test_excluded_terms_are_zero_and_reported():
    result = fit_nnls(synthetic(), exclude=["sum_P2"])
    assert result.model.coefficients["sum_P2"] == 0.0
    assert any("sum_P2 excluded on request" in w for w in result.warnings)
    with pytest.raises(FitError, match="not a term"):
        fit_nnls(synthetic(steps=8), exclude=["sum_Q"])
