"""The FLOP-count crossover ``fit-cost`` prints beside the fitted one: a mixture-of-experts layer
counts the parameters one token runs through (router and top-k experts), not all experts."""

from __future__ import annotations

import pytest

from loongforge.calibrate.fit_cost import flops_crossover_length
from loongforge.config.loader import load_run_config, to_dict
from loongforge.models.decoder.params import language_layer_parameters


def test_moe_crossover_counts_the_active_experts():
    model = to_dict(load_run_config("qwen3-30b-a3b"))["model"]
    crossover = flops_crossover_length(model, loss_share=0.0)
    # Qwen3-30B-A3B layer: q 2048x4096, k and v 2048x512, o 4096x2048, router 2048x128, and 8 of
    # its 128 experts (3 x 2048 x 768 each); norms 2 x 2048 + 2 x 128.
    active = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768 + 2 * 2048 + 2 * 128
    # Its attention is 32 heads x 128 channels = 4096 wide, twice the hidden size: QK^T and AV cost 4 L^2 x 4096.
    assert crossover["layers_only"] == pytest.approx(active / 4096, rel=1e-12)
    all_experts = language_layer_parameters(load_run_config("qwen3-30b-a3b").model.language)
    assert all_experts / 4096 > 9 * crossover["layers_only"]  # what counting every expert would give


def test_latent_attention_crossover_takes_its_query_and_value_widths():
    """DeepSeek-V3: QK^T over 128 heads x (128 + 64) channels, AV over 128 x 128: a mean width of 20480; the
    linear side the parameters a token runs through (the dense first layers' MLP, then 8 of 256 experts)."""
    model_cfg = load_run_config("deepseek-v3").model
    crossover = flops_crossover_length(to_dict(load_run_config("deepseek-v3"))["model"], loss_share=0.0)
    from loongforge.models.registry import get_family

    count = get_family("llm").count_parameters
    without_layers = count(model_cfg.__class__(**{**vars(model_cfg), "language": model_cfg.language.__class__(
        **{**vars(model_cfg.language), "num_layers": 0})}))["active"]
    active_layers = count(model_cfg)["active"] - without_layers
    assert crossover["layers_only"] == pytest.approx(active_layers / (20480 * 61), rel=1e-12)
    print(f"deepseek-v3: attention FLOPs equal the layers' linear FLOPs at {crossover['layers_only']:.0f} tokens")


def test_dense_crossover_counts_the_whole_mlp():
    model = to_dict(load_run_config("qwen2.5-7b"))["model"]
    crossover = flops_crossover_length(model, loss_share=0.5)
    # Qwen2.5-7B layer: q/o 3584x3584 (+ q bias), k/v 3584x512 (+ biases), MLP 3 x 3584 x 18944, 2 norms.
    layer = 2 * 3584 * 3584 + 3584 + 2 * (3584 * 512 + 512) + 3 * 3584 * 18944 + 2 * 3584
    assert crossover["layers_only"] == pytest.approx(layer / 3584, rel=1e-12)
    head = 0.5 * 152064 * 3584
    assert crossover["with_lm_head"] == pytest.approx((28 * layer + head) / (3584 * 28), rel=1e-12)
