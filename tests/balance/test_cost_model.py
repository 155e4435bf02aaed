"""The planner's price of a sample when several ranks share the encoder (parallel.encoder_dp), and one
rank's price of a row split over context-parallel ranks (parallel.encoder_cp on and off)."""

from __future__ import annotations

import pytest

from loongforge.balance.cost_model import (
    TERMS,
    VISION_TERMS,
    CostModel,
    SampleCost,
    batch_features,
    context_parallel_row_seconds,
    encoder_cp_gain,
    with_vision_spread,
)


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


def _seconds_model() -> CostModel:
    return CostModel({"sum_L2": 1e-9, "sum_L": 1e-5, "N": 1e-3, "sum_P2": 2e-9, "sum_P": 2e-5, "n_img": 1e-3,
                      "n_loss": 1e-6})


# Two samples: 1000 tokens with two images of 400 patches (100 loss tokens), 600 text tokens (200).
ROW = [SampleCost(1000, (400, 400), 100), SampleCost(600, (), 200)]


def test_a_cp_rank_pays_a_cp_share_of_the_language_and_its_share_of_the_media():
    """By hand at CP 2: language (1e-9 (1000^2 + 600^2) + 1e-5 * 1600 + 1e-6 * 300) / 2 + 1e-3 * 2
    samples (a per-sample overhead is paid on every rank) = 0.01083 s; one image 2e-9 * 400^2 +
    2e-5 * 400 + 1e-3 = 0.00932 s, one per rank with encoder_cp, both on every rank without."""
    model = _seconds_model()
    language, image = (0.01766 / 2 + 0.002), 0.00932
    assert context_parallel_row_seconds(model, ROW, 2, encoder_cp=True) == pytest.approx(language + image, rel=1e-12)
    assert context_parallel_row_seconds(model, ROW, 2, encoder_cp=False) == pytest.approx(language + 2 * image,
                                                                                          rel=1e-12)
    gain = encoder_cp_gain(model, ROW, 2)
    print(f"CP 2: encoder_cp on {gain.on_s:.5f} s, off {gain.off_s:.5f} s, gain {gain.gain:.2%}")
    assert gain.gain == pytest.approx(1 - 0.02015 / 0.02947, rel=1e-12)
    # CP 1 is the cost model's price of the whole row, encoder_cp or not.
    whole = float(model.predict_micro_batch(batch_features(ROW)))
    assert all(context_parallel_row_seconds(model, ROW, 1, encoder_cp=on) == pytest.approx(whole) for on in (True, False))


def test_media_are_dealt_whole_so_a_dominant_video_bounds_the_gain():
    """900 + 100 + 100 patches over CP 2: the 900-patch video alone on one rank is the slowest share."""
    model = _seconds_model()
    row = [SampleCost(2000, (900, 100, 100), 0)]
    language = (1e-9 * 2000 ** 2 + 1e-5 * 2000) / 2 + 1e-3

    def medium(patches):
        return 2e-9 * patches ** 2 + 2e-5 * patches + 1e-3

    gain = encoder_cp_gain(model, row, 2)
    assert gain.on_s == pytest.approx(language + medium(900), rel=1e-12)
    assert gain.off_s == pytest.approx(language + medium(900) + 2 * medium(100), rel=1e-12)
    with pytest.raises(ValueError, match="context_parallel must be at least 1"):
        context_parallel_row_seconds(model, row, 0, encoder_cp=True)
