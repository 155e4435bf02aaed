"""Modality-isolated experts (``models.decoder.modality_moe``) and the paired 3-D rotary
(``models.vlm.paired_mrope``): the decoder equals transformers' ERNIE-4.5-VL text model (its dense first
layer, then text and vision expert sets with their biased routers and the shared expert), on text alone
and on a row whose image tokens (and their markers) go to the vision experts under 3-D positions."""

from __future__ import annotations

import pytest
import torch

from loongforge.config.language_parts import MoEConfig
from loongforge.config.schema import LanguageConfig, ModelConfig, ParallelConfig
from loongforge.models.decoder import configs as decoder_configs
from loongforge.models.decoder.build import build_context, build_language_model
from loongforge.models.decoder.modality_moe import ModalityMoE, ScoreBiasRouter
from loongforge.models.hf.rules import GateUp, GroupedQKV
from loongforge.models.vlm.paired_mrope import PairedMRoPE, paired_axes

VOCAB, HIDDEN, HEADS, GROUPS, HEAD_DIM = 300, 64, 4, 2, 16
EXPERTS, TOPK, TEXT_FFN, VISION_FFN, SHARED = 4, 2, 32, 16, 2
SECTION = [3, 3, 2]
# The row's vision tokens: an image start, its placeholders, an image end (any ids the decoder is told of).
IMAGE_START, IMAGE, IMAGE_END = 290, 291, 292


def hf_text_model(seed: int = 0):
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeTextConfig
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import Ernie4_5_VLMoeTextModel

    config = Ernie4_5_VLMoeTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, rms_norm_eps=1e-5, moe_intermediate_size=[TEXT_FFN, VISION_FFN], moe_k=TOPK,
        moe_num_experts=EXPERTS, moe_num_shared_experts=SHARED,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0, "mrope_section": SECTION})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Ernie4_5_VLMoeTextModel(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "e_score_correction_bias" in name:  # large enough to change some choices
                param.copy_(0.2 * noise)
            else:
                param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model


def our_cfg() -> ModelConfig:
    lang = LanguageConfig(
        num_layers=3, hidden_size=HIDDEN, ffn_hidden_size=96, num_attention_heads=HEADS, num_query_groups=GROUPS,
        vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=500_000.0, mrope_section=SECTION, tie_word_embeddings=True,
        add_qkv_bias=False,
        moe=MoEConfig(num_experts=EXPERTS, ffn_hidden_size=TEXT_FFN, router_topk=TOPK, norm_topk_prob=True,
                      shared_expert_ffn_hidden_size=SHARED * TEXT_FFN, shared_expert_gate=False, first_dense_layers=1,
                      router_fp32=True, vision_ffn_hidden_size=VISION_FFN))
    return ModelConfig(language=lang)


def build_ours(model_cfg: ModelConfig):
    parallel = ParallelConfig()
    context = build_context(model_cfg, parallel, params_dtype=torch.float32, device="cpu", init_seed=0)
    config = decoder_configs.language_config(model_cfg.language, parallel, torch.float32, True, rotary_interleaved=True)
    model = build_language_model(model_cfg, config, context.modules, context.pgs, pre_process=True, post_process=True,
                                 vp_stage=None, init_seed=0, rope="mrope", takes_features=False,
                                 routing_token_ids=(IMAGE_START, IMAGE, IMAGE_END))
    model.rotary_pos_emb = PairedMRoPE(HEAD_DIM, SECTION, 500_000.0)
    return model.eval()


def _experts(state: dict, ours: str, fused_gate_up: torch.Tensor, fused_down: torch.Tensor) -> None:
    for e in range(fused_gate_up.shape[0]):
        gate, up = fused_gate_up[e].chunk(2, dim=0)
        state[f"{ours}.experts.local_experts.{e}.linear_fc1.weight"] = GateUp().shard([gate, up], 0, 1)
        state[f"{ours}.experts.local_experts.{e}.linear_fc2.weight"] = fused_down[e]


def copy_weights(model, hf) -> None:
    """transformers' text model -> ours (TP 1), by transformers' module names."""
    hf_state, state = hf.state_dict(), {}
    embedding = model.embedding.word_embeddings.weight.detach().clone()
    embedding[:VOCAB] = hf_state["embed_tokens.weight"]
    state["embedding.word_embeddings.weight"] = embedding
    state["decoder.final_layernorm.weight"] = hf_state["norm.weight"]
    qkv = GroupedQKV(HEADS, GROUPS, HEAD_DIM)
    for i in range(3):
        h, m = f"layers.{i}.", f"decoder.layers.{i}."
        state[m + "self_attention.linear_qkv.layer_norm_weight"] = hf_state[h + "input_layernorm.weight"]
        state[m + "self_attention.linear_qkv.weight"] = qkv.shard([hf_state[h + f"self_attn.{p}_proj.weight"]
                                                                   for p in "qkv"], 0, 1)
        state[m + "self_attention.linear_proj.weight"] = hf_state[h + "self_attn.o_proj.weight"]
        if i == 0:
            state[m + "mlp.linear_fc1.layer_norm_weight"] = hf_state[h + "post_attention_layernorm.weight"]
            state[m + "mlp.linear_fc1.weight"] = GateUp().shard([hf_state[h + "mlp.gate_proj.weight"],
                                                                 hf_state[h + "mlp.up_proj.weight"]], 0, 1)
            state[m + "mlp.linear_fc2.weight"] = hf_state[h + "mlp.down_proj.weight"]
            continue
        state[m + "pre_mlp_layernorm.weight"] = hf_state[h + "post_attention_layernorm.weight"]
        state[m + "mlp.expert_bias"] = torch.cat([hf_state[h + f"mlp.{kind}.gate.moe_statics.e_score_correction_bias"]
                                                  for kind in ("text_moe", "vision_moe")])
        for kind in ("text_moe", "vision_moe"):
            hk, mk = h + f"mlp.{kind}.", m + f"mlp.{kind}"
            state[mk + ".router.weight"] = hf_state[hk + "gate.weight"]
            _experts(state, mk, hf_state[hk + "experts.gate_up_proj"], hf_state[hk + "experts.down_proj"])
        hs = h + "mlp.shared_experts."
        state[m + "mlp.shared_experts.linear_fc1.weight"] = GateUp().shard([hf_state[hs + "gate_proj.weight"],
                                                                           hf_state[hs + "up_proj.weight"]], 0, 1)
        state[m + "mlp.shared_experts.linear_fc2.weight"] = hf_state[hs + "down_proj.weight"]
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def image_row(generator: torch.Generator):
    """ids [1, L] (text, an image of 2 x 3 merged tokens between its markers, text) and their 3-D positions
    [3, 1, L] as transformers numbers them (the image: t = h0 = w0 = the position after the text; h, w over
    the grid; the text after it from max(h, w) on)."""
    before, after = torch.randint(0, 280, (5,), generator=generator), torch.randint(0, 280, (4,), generator=generator)
    ids = torch.cat([before, torch.tensor([IMAGE_START] + [IMAGE] * 6 + [IMAGE_END]), after])[None]
    text_a = torch.arange(6).expand(3, 6)  # 5 text tokens and the start marker
    grid_h, grid_w = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    image = torch.stack([torch.full((6,), 6), 6 + grid_h.reshape(-1), 6 + grid_w.reshape(-1)])
    text_b = 9 + torch.arange(5).expand(3, 5)  # the end marker and 4 text tokens, after max(h, w) = 3
    return ids, torch.cat([text_a, image, text_b], dim=1)[:, None]


def modality(ids: torch.Tensor) -> torch.Tensor:
    return torch.isin(ids, torch.tensor([IMAGE_START, IMAGE, IMAGE_END])).long()


def test_paired_axes_alternate_height_and_width_then_time():
    assert paired_axes([3, 3, 2], 8).tolist() == [1, 2, 1, 2, 1, 2, 0, 0]
    with pytest.raises(ValueError, match="height and width as many"):
        paired_axes([3, 2, 3], 8)


def test_the_decoder_equals_transformers_text_and_image_tokens(megatron_world_of_one):
    hf, model = hf_text_model(), build_ours(our_cfg())
    copy_weights(model, hf)
    sparse = [layer.mlp for layer in model.decoder.layers if isinstance(layer.mlp, ModalityMoE)]
    assert len(sparse) == 2 and all(isinstance(m.text_moe.router, ScoreBiasRouter) for m in sparse)
    generator = torch.Generator().manual_seed(1)
    text = torch.randint(0, 280, (1, 17), generator=generator)
    ids, positions = image_row(generator)
    worst = 0.0
    for ids, positions in ((text, torch.arange(17).expand(3, 1, 17)), (ids, positions)):
        with torch.no_grad():
            hidden = hf(input_ids=ids, position_ids=positions, moe_mm_token_type_ids=modality(ids)).last_hidden_state
            expected = hidden @ hf.embed_tokens.weight.T
            ours = model(input_ids=ids, position_ids=positions, attention_mask=None)[..., :VOCAB]
        error = (ours - expected).abs().max().item() / expected.abs().max().item()
        worst = max(worst, error)
    print(f"modality-isolated decoder vs transformers: {worst:.2e} of the largest logit")
    assert worst < 1e-6


def test_routing_by_modality_and_bias_matters(megatron_world_of_one):
    """The same row with its image tokens sent to the text experts gives other logits (the vision experts ran),
    and so do routers without their bias (it chose some experts)."""
    hf, model = hf_text_model(), build_ours(our_cfg())
    copy_weights(model, hf)
    ids, positions = image_row(torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = hf(input_ids=ids, position_ids=positions, moe_mm_token_type_ids=torch.zeros_like(ids)).last_hidden_state
        text_routed = hidden @ hf.embed_tokens.weight.T
        ours = model(input_ids=ids, position_ids=positions, attention_mask=None)[..., :VOCAB]
        for layer in model.decoder.layers[1:]:  # the routers' fixed bias chooses too
            layer.mlp.expert_bias.zero_()
        unbiased = model(input_ids=ids, position_ids=positions, attention_mask=None)[..., :VOCAB]
    gap = (ours - text_routed).abs().max().item() / text_routed.abs().max().item()
    bias_gap = (ours - unbiased).abs().max().item() / ours.abs().max().item()
    print(f"image tokens through the text experts instead: {gap:.2e}; routers without their bias: {bias_gap:.2e} "
          f"of the largest logit")
    assert gap > 1e-3 and bias_gap > 1e-3


def test_the_section_names_what_modality_isolated_experts_cannot_be():
    fine = MoEConfig(num_experts=4, ffn_hidden_size=32, shared_expert_gate=False, vision_ffn_hidden_size=16)
    assert fine.problems(num_layers=3) == []
    problems = MoEConfig(num_experts=4, ffn_hidden_size=32, vision_ffn_hidden_size=16, aux_loss_coeff=0.01,
                         router_score_function="sigmoid").problems(num_layers=3)
    assert any("router_score_function='sigmoid' with vision_ffn_hidden_size" in p for p in problems)
    assert any("shared_expert_gate=True" in p for p in problems)
    assert not any("aux_loss_coeff" in p for p in problems)  # transformers' loss (modality_balance)
    assert "vision_ffn_hidden_size=0 must be at least 1" in MoEConfig(
        num_experts=4, ffn_hidden_size=32, vision_ffn_hidden_size=0).problems(num_layers=3)[0]
