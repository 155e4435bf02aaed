"""A hybrid decoder's arithmetic (Qwen3.5: Gated DeltaNet layers between gated full-attention ones,
``model.language.layer_types``): parameter counts against transformers' ``Qwen3_5TextModel`` built on the
meta device, the model FLOPs of each layer type (linear attention linear in the sample length, full
attention not), the FLOP crossover ``fit-cost`` prints, and the dry run's per-stage parameters and
activations. CPU only, no model is run; ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from loongforge.calibrate.fit_cost import flops_crossover_length
from loongforge.config.layout import derive_parallel_sizes
from loongforge.config.loader import load_run_config, to_dict
from loongforge.config.schema import LanguageConfig, LinearAttentionConfig, MoEConfig
from loongforge.models.decoder import linear_attention
from loongforge.models.decoder.params import language_layer_parameters, language_parameters
from loongforge.models.decoder.layer_costs import DELTA_RULE_CHUNK, gated_delta_rule_flops
from loongforge.models.flops import (
    FlopOptions,
    decoder_layer_forward_flops,
    language_flops,
    language_layer_passes,
)
from loongforge.train.dry_run import decoder_activation_bytes, split_parameters

LINEAR, FULL = "linear_attention", "full_attention"
# Qwen3.5's 3:1 pattern, an alternating one, and full attention only.
PATTERNS = {"three_to_one": [LINEAR, LINEAR, LINEAR, FULL], "alternating": [FULL, LINEAR, FULL, LINEAR],
            "full_only": [FULL] * 4}
TINY_SHAPE = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12,
                                   conv_kernel=4)


def tiny_language(layer_types: list[str], **changes) -> LanguageConfig:
    """A 4-layer, 64-wide Qwen3.5 decoder (unequal key and value head sizes, so a swapped width shows)."""
    linear = LINEAR in layer_types
    fields = dict(num_layers=len(layer_types), hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                  num_query_groups=2, head_dim=16, vocab_size=100, add_qkv_bias=False, qk_norm=True,
                  attention_output_gate=True, zero_centered_norms=True, partial_rotary_factor=0.25,
                  mrope_section=[], tie_word_embeddings=False, layer_types=list(layer_types),
                  linear_attention=TINY_SHAPE if linear else None)
    return LanguageConfig(**{**fields, **changes})


def hf_text_model(lang: LanguageConfig):
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    shape = lang.linear_attention or TINY_SHAPE
    config = Qwen3_5TextConfig(
        vocab_size=lang.vocab_size, hidden_size=lang.hidden_size, intermediate_size=lang.ffn_hidden_size,
        num_hidden_layers=lang.num_layers, num_attention_heads=lang.num_attention_heads,
        num_key_value_heads=lang.num_query_groups, head_dim=lang.head_dim, layer_types=lang.layer_types,
        linear_num_key_heads=shape.num_key_heads, linear_num_value_heads=shape.num_value_heads,
        linear_key_head_dim=shape.key_head_dim, linear_value_head_dim=shape.value_head_dim,
        linear_conv_kernel_dim=shape.conv_kernel, tie_word_embeddings=lang.tie_word_embeddings)
    with torch.device("meta"):
        return Qwen3_5TextModel(config)


def numel(parameters) -> int:
    return sum(p.numel() for p in parameters)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
def test_counts_equal_transformers_text_model_on_meta_device(pattern):
    lang = tiny_language(PATTERNS[pattern])
    hf = hf_text_model(lang)
    per_layer = [numel(layer.parameters()) for layer in hf.layers]
    counted = [language_layer_parameters(lang, layer_type=kind) for kind in lang.layer_types]
    # Qwen3_5TextModel: embed_tokens, layers, norm; no lm_head (an untied output layer of vocab x h).
    output_layer = lang.vocab_size * lang.hidden_size
    print(f"{pattern}: layers transformers {per_layer} counted {counted}; model transformers "
          f"{numel(hf.parameters())} counted {language_parameters(lang) - output_layer} (+ lm_head {output_layer})")
    assert counted == per_layer
    assert language_parameters(lang) - output_layer == numel(hf.parameters())


def test_moe_counts_equal_transformers_text_model_with_its_shared_expert():
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeTextModel

    lang = tiny_language(PATTERNS["three_to_one"], moe=MoEConfig(num_experts=8, ffn_hidden_size=24, router_topk=2,
                                                                 shared_expert_ffn_hidden_size=40))
    shape = lang.linear_attention
    config = Qwen3_5MoeTextConfig(
        vocab_size=lang.vocab_size, hidden_size=lang.hidden_size, num_hidden_layers=lang.num_layers,
        num_attention_heads=lang.num_attention_heads, num_key_value_heads=lang.num_query_groups,
        head_dim=lang.head_dim, layer_types=lang.layer_types, linear_num_key_heads=shape.num_key_heads,
        linear_num_value_heads=shape.num_value_heads, linear_key_head_dim=shape.key_head_dim,
        linear_value_head_dim=shape.value_head_dim, linear_conv_kernel_dim=shape.conv_kernel,
        num_experts=8, moe_intermediate_size=24, num_experts_per_tok=2, shared_expert_intermediate_size=40)
    with torch.device("meta"):
        hf = Qwen3_5MoeTextModel(config)
    output_layer = lang.vocab_size * lang.hidden_size
    counted = language_parameters(lang) - output_layer
    print(f"MoE: transformers {numel(hf.parameters())} counted {counted}; layers transformers "
          f"{[numel(layer.parameters()) for layer in hf.layers]}")
    assert counted == numel(hf.parameters())
    # The shared expert (SwiGLU 64 -> 40 and its gate 64 -> 1) is active for every token.
    routed_inactive = 6 * 3 * 64 * 24
    assert language_parameters(lang) - language_parameters(lang, active=True) == lang.num_layers * routed_inactive


def test_tied_embeddings_count_once_in_a_hybrid_model():
    lang = tiny_language(PATTERNS["three_to_one"], tie_word_embeddings=True)
    assert language_parameters(lang) == numel(hf_text_model(lang).parameters())


def test_the_layer_types_change_the_count_by_the_mixers_difference():
    hybrid, full = tiny_language(PATTERNS["three_to_one"]), tiny_language(PATTERNS["full_only"])
    # Gated DeltaNet (K = 2 x 8, V = 4 x 12, 4 value heads, h = 64): in_proj (2K + V + V + 2 x 4) x 64,
    # conv (2K + V) x 4, dt_bias and A_log 2 x 4, norm 12, out_proj V x 64.
    linear_mixer = (32 + 48 + 48 + 8) * 64 + 80 * 4 + 8 + 12 + 48 * 64
    # Gated attention (4 heads x 16, 2 groups): q_proj 2 x 64 x 64, k and v 32 x 64 each, o 64 x 64, q/k norms.
    full_mixer = 2 * 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16
    difference = language_parameters(full) - language_parameters(hybrid)
    print(f"mixer parameters: linear {linear_mixer}, gated full {full_mixer}; 3 layers swapped: {difference}")
    assert difference == 3 * (full_mixer - linear_mixer)


def test_the_output_gate_doubles_the_query_projection_only():
    gated = tiny_language(PATTERNS["full_only"])
    plain = dataclasses.replace(gated, attention_output_gate=False)
    q_width = gated.num_attention_heads * gated.head_dim
    assert (language_layer_parameters(gated) - language_layer_parameters(plain)) == q_width * gated.hidden_size


def test_a_config_without_layer_types_counts_as_before():
    lang = dataclasses.replace(tiny_language(PATTERNS["full_only"]), layer_types=[], attention_output_gate=False)
    explicit = dataclasses.replace(lang, layer_types=[FULL] * lang.num_layers)
    assert language_parameters(lang) == language_parameters(explicit)
    assert language_parameters(lang) == language_parameters(dataclasses.replace(lang, num_layers=0)) + (
        lang.num_layers * language_layer_parameters(lang))


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def qwen3_5_language() -> LanguageConfig:
    """Transformers' Qwen3_5TextConfig defaults: 32 layers (3:1), width 4096, 16 heads x 256, Gated
    DeltaNet 16 key heads and 32 value heads of 128."""
    pattern = [FULL if (index + 1) % 4 == 0 else LINEAR for index in range(32)]
    return LanguageConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=16,
                          num_query_groups=4, head_dim=256, vocab_size=248320, add_qkv_bias=False, qk_norm=True,
                          attention_output_gate=True, mrope_section=[], layer_types=pattern,
                          linear_attention=LinearAttentionConfig(16, 32, 128, 128, 4))


@pytest.mark.parametrize("length", [100, 64, 4096, 33])
def test_a_linear_attention_layers_flops_are_linear_in_the_sample_length(length):
    lang = qwen3_5_language()
    once, twice = (decoder_layer_forward_flops(lang, [n], LINEAR) for n in (length, 2 * length))
    print(f"linear-attention layer, forward: L={length} {once:.6e}, L={2 * length} {twice:.6e}, "
          f"ratio {twice / once:.6f}, per token {once / length:.6e}")
    assert twice == 2 * once
    # Packing does not change it either: two samples of L cost what one of 2L does.
    assert decoder_layer_forward_flops(lang, [length, length], LINEAR) == twice


@pytest.mark.parametrize("length", [100, 4096])
def test_a_full_attention_layers_flops_keep_the_quadratic_term(length):
    lang = qwen3_5_language()
    once, twice = (decoder_layer_forward_flops(lang, [n], FULL) for n in (length, 2 * length))
    q_width = lang.num_attention_heads * lang.head_dim
    print(f"full-attention layer, forward: L={length} {once:.6e}, L={2 * length} {twice:.6e}, "
          f"ratio {twice / once:.6f}")
    assert twice > 2 * once
    # f(L) = a L^2 + b L: f(2L) - 2 f(L) = 2 a L^2, a = 4 q_width (QK^T and AV over the L x L square).
    assert twice - 2 * once == 2 * 4 * q_width * length ** 2


def test_the_output_gate_adds_its_projection():
    lang = qwen3_5_language()
    plain = dataclasses.replace(lang, attention_output_gate=False)
    tokens, q_width = 1000, lang.num_attention_heads * lang.head_dim
    extra = decoder_layer_forward_flops(lang, [tokens], FULL) - decoder_layer_forward_flops(plain, [tokens], FULL)
    assert extra == 2 * tokens * lang.hidden_size * q_width


def test_a_hybrid_decoders_quadratic_term_counts_its_full_attention_layers_only():
    lang, options = qwen3_5_language(), FlopOptions()
    length, passes = 2048, language_layer_passes(options)
    once, twice = (language_flops(lang, [n], options) for n in (length, 2 * length))
    quadratic = (twice - 2 * once) // (2 * length ** 2)
    full_layers = lang.layer_types.count(FULL)
    q_width = lang.num_attention_heads * lang.head_dim
    per_type = {kind: decoder_layer_forward_flops(lang, [length], kind) for kind in (FULL, LINEAR)}
    print(f"decoder at L={length}: {once:.6e} FLOPs (fwd+bwd), per layer forward {per_type}; L^2 coefficient "
          f"{quadratic} = {passes} passes x 4 x {q_width} x {full_layers} full-attention layers")
    assert quadratic == passes * 4 * q_width * full_layers
    assert once == passes * (full_layers * per_type[FULL] + (32 - full_layers) * per_type[LINEAR])


def test_the_delta_rule_count_is_the_chunked_rules_matmuls_plus_flas_w_and_u_products():
    """FlopCounterMode over the plain-torch chunked rule (two samples of whole chunks): its matmuls are
    the count less the ``w`` and ``u`` products fla runs where it solves a triangular system."""
    tokens, shape, chunk = 192, TINY_SHAPE, DELTA_RULE_CHUNK
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(tokens, shape.num_key_heads, shape.key_head_dim, generator=generator) for _ in range(2))
    v = torch.randn(tokens, shape.num_value_heads, shape.value_head_dim, generator=generator)
    decay, beta = -torch.rand(tokens, shape.num_value_heads, generator=generator), torch.rand(
        tokens, shape.num_value_heads, generator=generator)
    with FlopCounterMode(display=False) as counter:
        linear_attention.chunked(q, k, v, decay, beta, cu_seqlens=torch.tensor([0, 64, tokens]), chunk_size=chunk)
    w_and_u = tokens * shape.num_value_heads * 2 * chunk * (shape.key_head_dim + shape.value_head_dim)
    counted, formula = counter.get_total_flops(), gated_delta_rule_flops(tokens, shape)
    print(f"gated delta rule, {tokens} tokens: FlopCounterMode {counted}, formula {formula} - w/u {w_and_u}")
    assert counted == formula - w_and_u


# ---------------------------------------------------------------------------------------------
# fit-cost's FLOP crossover and the dry run
# ---------------------------------------------------------------------------------------------


def test_the_flop_crossover_of_a_hybrid_model_prices_l2_on_its_full_attention_layers():
    cfg = load_run_config("qwen3.5-tiny")
    lang = cfg.model.language
    crossover = flops_crossover_length(to_dict(cfg)["model"], loss_share=0.0)
    layers = sum(language_layer_parameters(lang, layer_type=kind) for kind in lang.layer_types)
    rule = lang.layer_types.count(LINEAR) * gated_delta_rule_flops(1, lang.linear_attention)
    # Attention 4 L^2 x (heads x head_dim) per full-attention layer; Qwen3.5's heads are wider than h / heads.
    width = lang.num_attention_heads * (lang.head_dim or lang.hidden_size // lang.num_attention_heads)
    expected = (layers + rule / 2) / (width * lang.layer_types.count(FULL))
    print(f"qwen3.5-tiny FLOP crossover {crossover['layers_only']:.1f} tokens (every layer attention: "
          f"{layers / (width * lang.num_layers):.1f})")
    assert crossover["layers_only"] == pytest.approx(expected, rel=1e-12)


def hybrid_run(pattern: list[str], **parallel):
    cfg = load_run_config("llm-tiny")
    language = dataclasses.replace(tiny_language(pattern), vocab_size=cfg.model.language.vocab_size)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, language=language),
                               parallel=dataclasses.replace(cfg.parallel, **parallel))


def test_the_dry_run_counts_each_stages_layers_by_type(monkeypatch):
    from loongforge.train import dry_run

    # A text-only hybrid decoder (Qwen3.5's text model), which no family builds on its own yet: the family
    # check refuses it (hybrid layers under model.family=llm); the plan's counting by layer type is tested.
    monkeypatch.setattr(dry_run, "check_family_layout", lambda cfg: None)
    build_parallel_plan = dry_run.build_parallel_plan
    cfg = hybrid_run([LINEAR, LINEAR, LINEAR, FULL], pipeline_model_parallel_size=2, world_size=2)
    lang, plan = cfg.model.language, build_parallel_plan(cfg)
    linear, full = (language_layer_parameters(lang, layer_type=kind) for kind in (LINEAR, FULL))
    embedding = lang.vocab_size * lang.hidden_size
    print(f"stages: {[stage.params_per_rank for stage in plan.stages]}; layers linear {linear}, full {full}")
    assert plan.split.per_layer_by_type == {LINEAR: linear, FULL: full}
    assert plan.stages[0].params_per_rank == embedding + 2 * linear
    assert plan.stages[1].params_per_rank == linear + full + embedding  # and the untied LM head
    assert split_parameters(cfg.model).total == language_parameters(lang)


def test_the_dry_runs_linear_attention_activations_are_its_own():
    hybrid, full = hybrid_run(PATTERNS["three_to_one"]), hybrid_run(PATTERNS["full_only"])
    sizes = derive_parallel_sizes(hybrid.parallel)
    # Per token (K = 16, V = 48, 4 value heads, chunk 64): projection 2K + 2V + 8, rule inputs 2K + V + 8
    # + 4 x 64, outputs 2V; gated attention (q 64, kv 32): 2 x 64 + 2 x 32 + gate and gated output 2 x 64.
    linear_values = (32 + 96 + 8) + (32 + 48 + 8 + 256) + 96
    full_values = 2 * 64 + 2 * 32 + 2 * 64
    value_bytes = 4 if hybrid.training.precision == "fp32" else 2
    in_flight = min(sizes.pipeline_parallel, hybrid.training.global_batch_size // sizes.data_parallel)
    difference = decoder_activation_bytes(full, sizes) - decoder_activation_bytes(hybrid, sizes)
    print(f"activations per rank: full only {decoder_activation_bytes(full, sizes):.0f} B, hybrid "
          f"{decoder_activation_bytes(hybrid, sizes):.0f} B; values per token linear {linear_values}, "
          f"full {full_values}")
    assert difference == pytest.approx(hybrid.data.seq_len * in_flight * value_bytes * 3
                                       * (full_values - linear_values), rel=1e-12)
    longer = dataclasses.replace(hybrid, data=dataclasses.replace(hybrid.data, seq_len=2 * hybrid.data.seq_len))
    assert decoder_activation_bytes(longer, sizes) == pytest.approx(2 * decoder_activation_bytes(hybrid, sizes),
                                                                    rel=1e-12)


def test_context_parallel_adds_the_keys_each_chunk_sees_and_the_delta_rules_widened_state():
    """At CP 2 a rank holds half the tokens; per local token, attention also keeps the keys and values its two
    chunks see (CP + 1/2 = 2.5 times its own: 2 x 32 x 2.5) and Gated DeltaNet its convolution windows (3 more
    taps of 2K + V = 80) and the rule's d_k widened columns in and out (2 x 4 heads x 8)."""
    cp1 = hybrid_run(PATTERNS["three_to_one"])
    cp2 = hybrid_run(PATTERNS["three_to_one"], context_parallel_size=2, world_size=2)
    sizes1, sizes2 = derive_parallel_sizes(cp1.parallel), derive_parallel_sizes(cp2.parallel)
    value_bytes = 4 if cp1.training.precision == "fp32" else 2
    in_flight = min(sizes1.pipeline_parallel, cp1.training.global_batch_size // sizes1.data_parallel)
    per_token = {cp: decoder_activation_bytes(run, sizes) / (run.data.seq_len / cp) / value_bytes / in_flight
                 for cp, run, sizes in ((1, cp1, sizes1), (2, cp2, sizes2))}
    full_layers, linear_layers = 1, 3
    added = full_layers * 2 * 32 * 2.5 + linear_layers * (3 * 80 + 2 * 4 * 8)
    print(f"\nvalues per local token and layer stack: CP 1 {per_token[1]:.0f}, CP 2 {per_token[2]:.0f} (+{added:.0f})")
    assert per_token[2] - per_token[1] == pytest.approx(added, rel=1e-12)
