"""Qwen3VLModel with mixture-of-experts decoder layers (megatron-core's MoELayer, TP=1): the
load-balancing statistics give transformers' ``aux_loss`` (Qwen3VLMoeForConditionalGeneration) and
megatron-core's per-layer losses; the weight map reads the Hub's transposed expert layout too.
Logits and losses against transformers are test_qwen3_vl_parity.py's ("moe" variant).

Only the renormalised router is compared: transformers' Qwen3-VL-MoE has no other (the unnormalised
one, ``norm_topk_prob: false``, is checked against transformers' Qwen3-MoE in test_llm_parity)."""

import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.models.decoder.moe_balance import RouterStatistics, megatron_balance_loss, transformers_balance_loss
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.qwen3_vl.hf_mapping import to_hub_style
from loongforge.models.qwen3_vl.model import build_model
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.test_qwen3_vl_support import (
    TINY_VISION,
    build_hf_model,
    hf_position_ids,
    make_sample,
    our_inputs,
    tiny_model_cfg,
)

TOLERANCE = 1e-5
AUX_TOLERANCE = 1e-6

CASES = {"text": dict(), "one_image": dict(images=((1, 8, 12),)),
         "image_and_video": dict(images=((1, 6, 4),), videos=((2, 4, 6),))}


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


def _build(model_cfg):
    return build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True,
                       device="cpu", vision=TINY_VISION)


@pytest.fixture(scope="module")
def pair(world):
    model_cfg = tiny_model_cfg(experts=True)
    hf_model = build_hf_model(model_cfg)
    model = _build(model_cfg).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    return model_cfg, hf_model, model


def test_decoder_layers_are_megatrons_moe_layers_with_deepstack_hooks(pair):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model_cfg, _, model = pair
    layers = model.language_model.decoder.layers
    assert all(isinstance(layer.mlp, MoELayer) for layer in layers)
    assert len(layers[0].mlp.experts.local_experts) == model_cfg.language.num_experts
    hooked = [bool(layer._forward_hooks) for layer in layers]
    assert hooked == [index < TINY_VISION.num_deepstack_layers for index in range(len(layers))]


@pytest.mark.parametrize("case", CASES)
def test_router_statistics_give_transformers_aux_loss(pair, case):
    """Every token (text, image and video placeholders alike) goes through every router on both
    sides; transformers averages the statistics over layers before taking the product."""
    model_cfg, hf_model, model = pair
    sample = make_sample(model_cfg, **CASES[case])
    position_ids = hf_position_ids(hf_model, sample)
    with torch.no_grad():
        reference = hf_model(
            input_ids=sample.input_ids, position_ids=position_ids, pixel_values=sample.pixel_values,
            image_grid_thw=sample.image_grid_thw, pixel_values_videos=sample.pixel_values_videos,
            video_grid_thw=sample.video_grid_thw, output_router_logits=True,
        ).aux_loss
        with RouterStatistics(model).record() as recorded:
            model(**our_inputs(sample, position_ids))
    assert len(recorded.statistics) == model_cfg.language.num_layers
    diff = abs(float(transformers_balance_loss(recorded.statistics)) - float(reference))
    print(f"{case}: aux loss {float(reference):.6f}, diff {diff:.3e}")
    assert diff <= AUX_TOLERANCE


def test_router_statistics_give_megatrons_per_layer_losses(world):
    """In training megatron-core adds each layer's own loss (``moe_balance`` says how it differs)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    model_cfg = tiny_model_cfg(experts=True)
    model = _build(model_cfg).train()
    load_hf_state_dict(model, build_hf_model(model_cfg).state_dict())
    sample = make_sample(model_cfg, **CASES["one_image"])
    from loongforge.models.qwen3_vl.rope_index import position_ids_for

    position_ids = position_ids_for(model_cfg)(sample.input_ids[0], sample.image_grid_thw, None)[:, None]
    clear_aux_losses_tracker()
    with RouterStatistics(model).record() as recorded:
        model(**our_inputs(sample, position_ids))
    per_layer = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]  # aux / coeff
    ours = megatron_balance_loss(recorded.statistics, model_cfg.language.moe_router_topk)
    assert abs(float(per_layer.sum()) - float(ours)) <= AUX_TOLERANCE
    clear_aux_losses_tracker()


def _hub_layout(hf_state: dict) -> dict:
    """The Hub's Qwen3-VL-MoE files: fused expert tensors with their two trailing axes swapped."""
    return {key: value.transpose(1, 2).contiguous() if key.endswith((".experts.gate_up_proj", ".experts.down_proj"))
            else value for key, value in hf_state.items()}


def test_weights_round_trip_and_the_hubs_expert_layout_reads_the_same(pair):
    """Every HF tensor is written back unchanged (fused experts in transformers 5's layout); a state
    dict in the Hub's transposed expert layout loads into the same weights."""
    model_cfg, hf_model, model = pair
    expected = to_hub_style(hf_model.state_dict())
    written = megatron_to_hf([model.state_dict()], model_cfg)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[key], expected[key]) for key in expected)
    assert written["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 48, 64)

    from_hub = _build(model_cfg).eval()
    hub_state = _hub_layout(hf_model.state_dict())
    assert hub_state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 2 * 48)
    load_hf_state_dict(from_hub, hub_state)
    ours = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(v, ours[k]) for k, v in from_hub.state_dict().items() if isinstance(v, torch.Tensor))


def test_an_expert_parallel_rank_takes_its_experts_from_the_fused_tensors(pair):
    """With EP 2, rank 1 holds experts 2 and 3 as its local experts 0 and 1 (``ExpertPlacement``)."""
    from loongforge.models.hf.weights import ExpertPlacement, hf_to_megatron

    model_cfg, hf_model, model = pair
    full = model.state_dict()
    local = {0: 2, 1: 3}
    keys = [k for k in full if any(f".local_experts.{e}." in k for e in local)]
    second_rank = hf_to_megatron(hf_model.state_dict(), model_cfg, keys,
                                 experts=ExpertPlacement(offset=2, tp_rank=0, tp_size=1))
    assert len(second_rank) == 2 * 2 * model_cfg.language.num_layers  # fc1 and fc2 of 2 experts a layer
    for key, tensor in second_rank.items():
        e = next(e for e in local if f".local_experts.{e}." in key)
        assert torch.equal(tensor, full[key.replace(f".local_experts.{e}.", f".local_experts.{local[e]}.")]), key
