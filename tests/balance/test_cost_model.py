"""The planner's price of a sample when several ranks share the encoder (parallel.encoder_dp)."""

from __future__ import annotations

import pytest

from loongforge.balance.cost_model import TERMS, VISION_TERMS, CostModel, with_vision_spread


def _model() -> CostModel:
    return CostModel({t: float(i + 1) for i, t in enumerate(TERMS)}, source="fit:nnls")


def test_vision_terms_are_divided_by_the_ranks_and_nothing_else():
    model = _model()
    spread = with_vision_spread(model, 4)
    for term in TERMS:
        expected = model.coefficients[term] / 4 if term in VISION_TERMS else model.coefficients[term]
        assert spread.coefficients[term] == expected, term
    assert model.coefficients["sum_P2"] == 4.0  # the run's model itself is left alone
    assert spread.source == model.source
    # One image of 16 patches in a 100-token sample: the language part is unchanged.
    full, quarter = (m.sample_costs([100], [[16]], [10])[0] for m in (model, spread))
    vision = 4.0 * 16 * 16 + 5.0 * 16 + 6.0
    assert full - quarter == pytest.approx(vision * 3 / 4)


def test_one_rank_is_the_model_and_zero_ranks_an_error():
    model = _model()
    assert with_vision_spread(model, 1) is model
    with pytest.raises(ValueError, match="at least 1"):
        with_vision_spread(model, 0)
