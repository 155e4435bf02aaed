"""ERNIE-4.5-VL (``models/ernie4_5_vl``): config.json both ways, the weight map against transformers' tensors,
and the whole model (tower, resampler, modality-isolated experts, 3-D positions) equal to transformers on
text, one image and two images of other proportions."""

from __future__ import annotations

import dataclasses

import jinja2
import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.models.ernie4_5_vl.chat import CHAT
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.media import MediaBatch
from loongforge.models.registry import get_family

from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.ernie_helpers import build_hf, sample, tiny_cfg, tiny_hf_config_dict



FAMILY = get_family("ernie4_5_vl")


def test_config_json_both_ways():
    model_cfg = tiny_cfg()
    lang = model_cfg.language
    assert (lang.moe.num_experts, lang.moe.ffn_hidden_size, lang.moe.vision_ffn_hidden_size) == (4, 32, 16)
    assert lang.moe.shared_expert_ffn_hidden_size == 64 and lang.moe.first_dense_layers == 1
    assert model_cfg.vision.arch == "ernie_vit" and model_cfg.projector.out_hidden_size == 64
    assert FAMILY.config_from_hf(FAMILY.config_to_hf(model_cfg), "again") == model_cfg
    from transformers import Ernie4_5_VLMoeConfig

    written = FAMILY.config_to_hf(model_cfg)
    back = Ernie4_5_VLMoeConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert back.text_config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert FAMILY.config_problems(model_cfg) == []


def test_hf_shapes_are_transformers_tensors():
    model_cfg = tiny_cfg()
    hub = FAMILY.to_hub_style(build_hf(model_cfg).state_dict())
    hub.pop("lm_head.weight")  # tied: the Hub's files have none
    assert FAMILY.hf_shapes(model_cfg) == {k: tuple(v.shape) for k, v in hub.items()}


@pytest.fixture(scope="module")
def pair():
    init_megatron(rank=0, world_size=1, port=free_port())
    model_cfg = tiny_cfg()
    hf = build_hf(model_cfg)
    model = FAMILY.build(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                         post_process=True, device="cpu").eval()
    load_hf_state_dict(model, hf.state_dict())
    yield model_cfg, hf, model
    destroy_megatron()


@pytest.mark.parametrize("images", [(), ((1, 4, 6),), ((1, 4, 6), (1, 6, 2))], ids=["text", "one_image", "two_images"])
def test_logits_equal_transformers(pair, images):
    model_cfg, hf, model = pair
    ids, rows, grids, kinds, experts = sample(images)
    positions = FAMILY.position_ids(model_cfg)(ids[0], grids, None, None)[:, None]
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=rows, image_grid_thw=grids, mm_token_type_ids=kinds,
                      moe_mm_token_type_ids=experts).logits
        hf_positions, _ = hf.model.get_rope_index(ids, kinds, image_grid_thw=grids) if images else (positions, None)
        media = MediaBatch.of(pixel_values=rows, image_grid_thw=grids)
        ours = model(input_ids=ids, position_ids=positions, media=media)[..., :300]
    assert torch.equal(hf_positions, positions)
    error = ((ours - expected).abs().max() / expected.abs().max()).item()
    print(f"ERNIE-4.5-VL {len(images)} image(s) vs transformers: {error:.2e} of the largest logit")
    assert error < 2e-6


def test_the_weight_map_writes_back_what_it_read(pair):
    model_cfg, hf, model = pair
    hub = FAMILY.to_hub_style(hf.state_dict())
    hub.pop("lm_head.weight")  # tied: not written
    written = megatron_to_hf([model.state_dict()], model_cfg)
    assert set(written) == set(hub)
    assert all(torch.equal(written[k], hub[k]) for k in hub)


def test_the_processor_is_bit_equal_to_transformers_on_two_photos():
    """Two COCO photos of other proportions (640 x 457, 480 x 640) through the family's image processing and
    transformers' (the PIL backend), at the 28B preset's pixel bounds and at small ones: the same grids and
    bit-equal patch rows."""
    from PIL import Image
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    from loongforge.config.loader import load_run_config
    from loongforge.models import parts
    from tests.models.references import TALL_PHOTO, WIDE_PHOTO

    cfg = load_run_config("ernie4.5vl-28b-a3b")
    for data in (cfg.data, dataclasses.replace(cfg.data, min_pixels=56 * 56, max_pixels=28 * 28 * 16)):
        ours = parts.image_processing(FAMILY, cfg.model, data)
        theirs = Ernie4_5_VLMoeImageProcessorPil(size={"shortest_edge": data.min_pixels, "longest_edge": data.max_pixels})
        for path in (WIDE_PHOTO, TALL_PHOTO):
            image = Image.open(path).convert("RGB")
            rows, grid = ours.pixels(image)
            expected = theirs(images=[image], return_tensors="np")
            assert list(grid) == expected["image_grid_thw"][0].tolist()
            assert (rows == expected["pixel_values"]).all(), (path.name, data.max_pixels)
            print(f"{path.name} at max_pixels {data.max_pixels}: grid {list(grid)}, {rows.shape[0]} rows bit-equal")


def test_adapters_on_both_expert_sets_are_sized_by_their_set(pair):
    """``lora.experts``: every text and vision expert's fc1 / fc2 gets an adapter of its own set's width (the
    vision set's narrower), the model's count is the plan's, and the adapted model runs and moves the logits.
    (transformers keeps each set's experts fused, with no PEFT module per expert: no PEFT reference.)"""
    from loongforge.config.schema import LoraConfig
    from loongforge.models.layers.lora import apply_lora
    from loongforge.models.layers.lora_params import adapter_parameters, merged_weight

    model_cfg, hf, _ = pair
    model = FAMILY.build(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                         post_process=True, device="cpu").eval()
    load_hf_state_dict(model, hf.state_dict())
    ids, rows, grids, _, _ = sample(((1, 4, 6),))
    inputs = dict(input_ids=ids, position_ids=FAMILY.position_ids(model_cfg)(ids[0], grids, None, None)[:, None],
                  media=MediaBatch.of(pixel_values=rows, image_grid_thw=grids))
    with torch.no_grad():
        before = model(**inputs)
    lora_cfg = LoraConfig(rank=4, experts=True)
    counts = apply_lora(model, model_cfg, lora_cfg, seed=0)
    assert counts["language.expert_fc1"] == counts["language.expert_fc2"] == 2 * 2 * 4  # 2 layers x 2 sets x 4
    mlp = model.language_model.decoder.layers[1].mlp
    for moe, width in ((mlp.text_moe, 32), (mlp.vision_moe, 16)):
        fc2 = moe.experts.local_experts[0].linear_fc2
        assert fc2.lora.A.shape[1] == width, (fc2.lora.A.shape, width)  # row-parallel: A [r, ffn]
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)
    assert adapters == adapter_parameters(model_cfg, lora_cfg, tensor_parallel=1, vision_tensor_parallel=1,
                                          expert_parallel=1).total
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora.B"):
                param.normal_(0, 0.1)
        after = model(**inputs)
        # A vision expert's adapted fc1 (gate and up fused) is its merged weight's linear.
        fc1 = mlp.vision_moe.experts.local_experts[1].linear_fc1
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
        parts = torch.arange(32) // 16  # the gate's rows, then the up's
        merged = merged_weight(fc1.weight, fc1.lora.A, fc1.lora.B, parts, fc1.lora.scaling)
        adapted, _ = fc1(x[:, None])
        merged_error = (adapted[:, 0] - x @ merged.t()).abs().max().item()
    assert merged_error < 2e-6, merged_error
    moved = ((after - before).abs().max() / before.abs().max()).item()
    print(f"ERNIE-4.5-VL adapters on both expert sets: {counts}, {adapters} parameters; they move the logits "
          f"{moved:.1e} of the largest; a vision expert's adapted fc1 vs its merged weight {merged_error:.1e}")
    assert moved > 1e-3


def test_each_image_is_labelled_by_its_count_in_the_conversation():
    """The published template writes ``Picture n:`` before each image, n counting over the whole conversation; the
    Jinja twin (what a served folder renders) writes the same."""
    turns = [Turn("user", "<image>What is it?"), Turn("assistant", "A cat."),
             Turn("user", "And these? <image><image>"), Turn("assistant", "Two dogs.")]
    text = render_chat(turns, None, CHAT).text
    print(f"\n{text!r}")
    assert [text.find(f"Picture {n}:<|IMAGE_START|>") >= 0 for n in (1, 2, 3)] == [True] * 3
    assert text.index("Picture 1:") < text.index("What is it?") < text.index("Picture 2:") < text.index("Picture 3:")
    rendered = jinja2.Environment().from_string(CHAT.jinja_template).render(messages=turns_to_hf_messages(turns))
    assert rendered == text


def test_the_balance_loss_is_transformers_over_all_sparse_layers(pair):
    """With ``aux_loss_coeff``: the objective (cross entropy + coeff x aux) and both routers' weight gradients of
    every sparse layer equal transformers' (``output_router_logits``, ``labels``, ``router_aux_loss_coef``) on a
    row with an image and padding (``attention_mask``: out of the statistics), and aux its ``aux_loss``. aux is
    one product over the layers' summed statistics (``models.decoder.modality_balance``), far from megatron-core's
    per-layer sum, and it moves the routers' gradients far beyond the error."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from loongforge.models.decoder.moe_balance import megatron_balance_loss, transformers_balance_loss

    coeff, padding = 0.5, 5
    overrides = dict(output_router_logits=True, router_aux_loss_coef=coeff)
    model_cfg = tiny_cfg(**overrides)
    assert model_cfg.language.moe.aux_loss_coeff == coeff
    hf = build_hf(model_cfg, **overrides).train()
    model = FAMILY.build(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                         post_process=True, device="cpu").train()
    load_hf_state_dict(model, hf.state_dict())
    ids, rows, grids, kinds, experts = sample(((1, 4, 6),))
    real = ids.shape[1]
    pad = lambda t: torch.cat([t, torch.zeros(1, padding, dtype=t.dtype)], dim=1)  # noqa: E731
    ids, kinds, experts = pad(ids), pad(kinds), pad(experts)
    attention = (torch.arange(real + padding) < real).long()[None]
    labels = torch.where(attention.bool(), ids, -100)
    expected = hf(input_ids=ids, attention_mask=attention, labels=labels, pixel_values=rows, image_grid_thw=grids,
                  mm_token_type_ids=kinds, moe_mm_token_type_ids=experts)
    expected.loss.backward()
    # Each layer's statistics over the real tokens, from transformers' router logits.
    statistics = []
    for logits in expected.router_logits:
        probs = torch.softmax(logits[:real].float(), dim=-1)
        counts = torch.zeros(4).scatter_add_(0, probs.topk(2).indices.reshape(-1), torch.ones(2 * real))
        statistics.append((counts / real, probs.mean(dim=0)))

    def router_grads(coefficient: float) -> dict[str, torch.Tensor]:
        model.zero_grad()
        clear_aux_losses_tracker()
        for layer in model.language_model.decoder.layers[1:]:
            for moe in (layer.mlp.text_moe, layer.mlp.vision_moe):
                moe.router.config.moe_aux_loss_coeff = coefficient
        loss_mask = torch.zeros(1, real + padding)
        loss_mask[0, :real - 1] = 1.0
        per_token = model(input_ids=ids, position_ids=FAMILY.position_ids(model_cfg)(ids[0], grids, None, None)[:, None],
                          labels=torch.roll(ids, -1, dims=1), media=MediaBatch.of(pixel_values=rows, image_grid_thw=grids),
                          loss_mask=loss_mask, padding_mask=~attention.bool())
        cross_entropy = (per_token * loss_mask).sum() / loss_mask.sum()
        cross_entropy.backward()
        router_grads.aux = float(get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].sum())
        router_grads.objective = float(cross_entropy) + coefficient * router_grads.aux
        return {f"{i}.{kind}": getattr(layer.mlp, f"{kind}_moe").router.weight.grad.clone()
                for i, layer in enumerate(model.language_model.decoder.layers) if i
                for kind in ("text", "vision")}

    ours = router_grads(coeff)
    aux, objective = router_grads.aux, router_grads.objective
    without = router_grads(0.0)
    clear_aux_losses_tracker()
    with torch.no_grad():  # evaluation: nothing counted or logged
        model.eval()(input_ids=ids, position_ids=FAMILY.position_ids(model_cfg)(ids[0], grids, None, None)[:, None],
                     media=MediaBatch.of(pixel_values=rows, image_grid_thw=grids), padding_mask=~attention.bool())
    assert float(get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].abs().sum()) == 0.0
    hf_layers = hf.model.language_model.layers
    theirs = {f"{i}.{kind}": getattr(hf_layers[i].mlp, f"{kind}_moe").gate.weight.grad for i in (1, 2)
              for kind in ("text", "vision")}
    scale = max(t.abs().max() for t in theirs.values())
    grad_error = max((ours[k] - theirs[k]).abs().max() for k in theirs) / scale
    moved = max((without[k] - theirs[k]).abs().max() for k in theirs) / scale
    aux_error, loss_error = abs(aux - float(expected.aux_loss)), abs(objective - float(expected.loss))
    per_layer_gap = abs(float(megatron_balance_loss(statistics, 2)) - aux)
    print(f"ERNIE-4.5-VL balance loss vs transformers (coeff {coeff}, {padding} padding tokens): aux {aux:.6f} "
          f"({aux_error:.1e}), objective {loss_error:.1e}, router grads {grad_error:.1e} of the largest (the aux term "
          f"moves them {moved:.1e}); megatron's per-layer sum would differ by {per_layer_gap:.2e}")
    assert abs(float(transformers_balance_loss(statistics)) - float(expected.aux_loss)) < 1e-6
    assert aux_error < 3e-6 and loss_error < 3e-6
    assert grad_error < 3e-6 and moved > 1e-3
    assert per_layer_gap > 1e-2
