"""Qwen3-MoE's published sizes (Qwen3-30B-A3B: 30.5B total, 3.3B active), dense models' active count, the
expert fields through config.json and the FLOPs of the routed experts (the counts against transformers for
every preset: ``test_counts.py``)."""

from loongforge.config.loader import load_run_config
from loongforge.models.registry import get_family


def test_qwen3_30b_a3b_published_sizes():
    counts = get_family("llm").count_parameters(load_run_config("qwen3-30b-a3b").model)
    assert counts["total"] == 30_532_122_624 and round(counts["total"] / 1e9, 1) == 30.5
    # Qwen's model card: 3.3B activated (3.35B, with the embedding and the output layer, written
    # truncated); 29.9B without the embedding and the output layer.
    assert 3.3e9 <= counts["active"] < 3.4e9
    lang = load_run_config("qwen3-30b-a3b").model.language
    assert round((counts["total"] - 2 * lang.vocab_size * lang.hidden_size) / 1e9, 1) == 29.9


def test_dense_models_count_every_parameter_active():
    counts = get_family("llm").count_parameters(load_run_config("qwen3-8b").model)
    assert counts["active"] == counts["total"]


def test_hf_config_round_trips_through_model_config():
    """config.json (as written for the preset) -> ModelConfig -> config.json: the expert fields survive."""
    family = get_family("llm")
    model_cfg = load_run_config("qwen3-30b-a3b").model
    hf_dict = family.config_to_hf(model_cfg)
    assert (hf_dict["num_experts"], hf_dict["num_experts_per_tok"], hf_dict["moe_intermediate_size"]) == (128, 8, 768)
    assert hf_dict["norm_topk_prob"] is True and hf_dict["router_aux_loss_coef"] == 0.001
    again = family.config_from_hf(hf_dict, "config.json")
    assert again.language == model_cfg.language


def test_flops_count_the_routed_experts_only():
    """A MoE layer's MLP FLOPs per token: the router plus top-k experts, not the dense width."""
    import dataclasses

    from loongforge.balance.cost_model import SampleCost

    moe = load_run_config("qwen3-moe-tiny").model
    lang = moe.language
    as_dense = dataclasses.replace(moe, language=dataclasses.replace(
        lang, moe=None, ffn_hidden_size=lang.moe.router_topk * lang.moe.ffn_hidden_size))
    training_flops = get_family(moe.family).training_flops
    router = 2 * lang.hidden_size * lang.moe.num_experts * lang.num_layers * 10
    # Forward + backward: 3 x the forward's router matmuls.
    samples = [SampleCost(tokens=10)]
    assert training_flops(moe, samples).language == training_flops(as_dense, samples).language + 3 * router
