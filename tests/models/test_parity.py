"""Parity with transformers at TP 1, every registered reference (``references.REFERENCES``) in fp32 with
every parameter random: logits and per-token loss (whole and loss-masked) on text and on each media
layout the family has; a packed (thd) row of three samples gives each sample its own logits and the
loss-masked loss, and the same row run as one sample does not (the segment boundaries are in force);
the training step's answer-masked loss of two packed samples and a padding tail equals transformers'
mean loss. Then the checks one family proves for a code path it alone has (docs/testing.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from loongforge.config.schema import ParallelConfig
from loongforge.models.decoder.moe_balance import RouterStatistics, megatron_balance_loss, transformers_balance_loss
from loongforge.models.hf.weights import ExpertPlacement, hf_to_megatron, load_hf_state_dict, megatron_to_hf
from loongforge.models.qwen3_vl.rope_index import position_ids_for
from loongforge.models.media import MediaBatch
from loongforge.models.registry import get_family
from loongforge.models.vlm.deepstack import check_pipeline
from loongforge.parallel import mcore_patches
from loongforge.train.step import make_forward_step
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.references import REFERENCES, Case, Reference, packed, reference_logits
from tests.models.test_qwen3_vl_support import TINY_VISION

VOCAB_ALIGNMENT = 128  # megatron pads the vocabulary to a multiple of this (times TP)


@dataclasses.dataclass
class Pair:
    reference: Reference
    model_cfg: object
    hf_model: torch.nn.Module
    model: torch.nn.Module

    def case(self, layout: str = "text", **options) -> Case:
        return self.reference.sample(self.model_cfg, self.hf_model, **self.reference.layouts[layout], **options)


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


@pytest.fixture(scope="module", params=list(REFERENCES))
def pair(world, request) -> Pair:
    """One reference's models, built once for every test of this module that uses it."""
    reference = REFERENCES[request.param]
    return Pair(reference, *reference.pair())


def _labels(case: Case, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random labels [1, s] and a random loss mask [1, s] (about half the positions)."""
    generator = torch.Generator().manual_seed(seed)
    shape = case.ours["input_ids"].shape
    return torch.randint(0, vocab, shape, generator=generator), (torch.rand(shape, generator=generator) < 0.5).float()


def test_logits_and_loss_match_transformers(pair):
    reference, model = pair.reference, pair.model
    vocab = pair.model_cfg.language.vocab_size
    for layout in reference.layouts:
        case = pair.case(layout)
        expected = reference_logits(pair.hf_model, case)  # [1, s, V]
        labels, loss_mask = _labels(case, vocab, seed=1)
        with torch.no_grad():
            logits = model(**case.ours)  # [1, s, V padded]
            loss = model(**case.ours, labels=labels)
            masked = model(**case.ours, labels=labels, loss_mask=loss_mask)
        assert logits.shape[:2] == expected.shape[:2] and logits.shape[2] == -(-vocab // VOCAB_ALIGNMENT) * 128
        diff = reference.difference(logits[..., :vocab], expected)
        print(f"\n{reference.name} {layout}: logits differ by {diff:.1e}{' of the largest' * reference.relative}")
        assert diff <= reference.tolerance, layout
        expected_loss = F.cross_entropy(expected[0], labels[0], reduction="none")
        assert loss.dtype == torch.float32 and loss.shape == labels.shape, layout
        assert reference.difference(loss[0], expected_loss) <= reference.tolerance, layout
        picked = loss_mask[0].bool()
        assert (masked[0, ~picked] == 0).all(), layout  # the head ran on masked positions only
        assert reference.difference(masked[0, picked], expected_loss[picked]) <= reference.tolerance, layout


def test_packed_row_gives_each_sample_its_own_logits(pair):
    """Three samples in one thd row (where the family has media: the two of ``Reference.packed_media``, then text):
    each sample's logits equal transformers' on it alone, the loss-masked loss too; the row run as one
    sample (attention, convolution or recurrent state across the boundaries) does not."""
    reference, model = pair.reference, pair.model
    first, second = reference.packed_media if reference.has_media else ("text", "text")
    samples = [pair.case(first, seed=1, text_len=12), pair.case(second, seed=2, text_len=7),
               pair.case("text", seed=3, text_len=20)]
    expected = [reference_logits(pair.hf_model, s)[0] for s in samples]
    lengths = [s.length for s in samples]
    row = packed(samples)
    vocab = pair.model_cfg.language.vocab_size
    labels, loss_mask = _labels(row, vocab, seed=4)
    as_one = packed([row])  # the same tokens, one segment
    with torch.no_grad():
        logits = model(**row.ours)[0, :, :vocab]
        loss = model(**row.ours, labels=labels, loss_mask=loss_mask)[0]
        one_sample = model(**{**row.ours, "packed_seq_params": as_one.ours["packed_seq_params"]})[0, :, :vocab]
    worst = max(reference.difference(got, want) for got, want in zip(logits.split(lengths), expected))
    leaked = reference.difference(one_sample.split(lengths)[2], expected[2])
    relative_leak = leaked if reference.relative else leaked / float(expected[2].abs().max())
    print(f"\n{reference.name} packed row vs each sample alone: {worst:.2e}; the row as one sample: "
          f"{relative_leak:.2e} of the largest")
    assert worst <= reference.tolerance and relative_leak > 1e-2
    picked = loss_mask[0].bool()
    expected_loss = F.cross_entropy(torch.cat(expected), labels[0], reduction="none")
    assert reference.difference(loss[picked], expected_loss[picked]) <= reference.tolerance
    assert (loss[~picked] == 0).all()


def _answer_labels(case: Case, answer: list[range]) -> torch.Tensor:
    """transformers' labels [1, s]: the input ids on answer positions, -100 (ignored) elsewhere."""
    input_ids = case.ours["input_ids"]
    labels = torch.full_like(input_ids, -100)
    for span in answer:
        labels[0, span] = input_ids[0, span]
    return labels


def _shifted(hf_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The data pipeline's form of the same targets (data.collate): labels[t] = the token at t+1 and
    loss_mask[t] = 1 where that token is an answer token; 0 at the sample's last position."""
    following = torch.cat([hf_labels[0, 1:], torch.tensor([-100])])
    mask = following != -100
    return torch.where(mask, following, 0), mask.float()


def test_answer_masked_packed_loss_matches_transformers_loss(pair):
    """The training step's loss: two samples and a padding tail packed in one row, the LM head on answer
    tokens only (``loss_mask``), summed and divided by the loss-token count (train.step); against
    transformers' mean loss over labels != -100, per sample, weighted by its token count."""
    reference, model = pair.reference, pair.model
    samples = [pair.case(reference.packed_media[0] if reference.has_media else "text", seed=1, text_len=12),
               pair.case("text", seed=2, text_len=20)]
    # Answers: the closing 5 tokens and a span inside the opening text, as in a multi-turn chat.
    answers = [_answer_labels(s, [range(2, 6), range(s.length - 5, s.length)]) for s in samples]
    hf_sums, hf_counts = [], []
    for sample, labels in zip(samples, answers):
        with torch.no_grad():
            hf_loss = pair.hf_model(**sample.theirs, labels=labels).loss
        count = int((labels[0, 1:] != -100).sum())  # transformers shifts: token t+1 from position t
        assert count == 9  # the 4 + 5 answer tokens
        hf_sums.append(float(hf_loss) * count)
        hf_counts.append(count)
    pad = 3
    targets = [_shifted(labels) for labels in answers]
    lengths = [s.length for s in samples] + [pad]
    row = packed(samples)
    batch = {
        "input_ids": torch.cat([row.ours["input_ids"], torch.zeros(1, pad, dtype=torch.long)], dim=1),
        "labels": torch.cat([t[0] for t in targets] + [torch.zeros(pad, dtype=torch.long)])[None],
        "loss_mask": torch.cat([t[1] for t in targets] + [torch.zeros(pad)])[None],
        "position_ids": torch.cat([row.ours["position_ids"], torch.arange(pad).expand(3, 1, pad)], dim=2),
        "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
        **{key: value for key, value in row.ours.items()
           if key not in ("input_ids", "position_ids", "packed_seq_params") and value is not None},
    }
    with torch.no_grad():
        output, loss_func = make_forward_step(torch.device("cpu"))(iter([batch]), model)
        loss_sum, num_tokens, _ = loss_func(output)
    assert int(num_tokens) == sum(hf_counts)
    assert (output[batch["loss_mask"] == 0] == 0).all()  # the head ran on answer tokens only
    expected = sum(hf_sums) / sum(hf_counts)
    diff = abs(float(loss_sum) / int(num_tokens) - expected)
    print(f"\n{reference.name} answer-masked packed loss: {expected:.4f}, differs by {diff:.1e}")
    assert diff <= reference.tolerance * (expected if reference.relative else 1.0)


@pytest.mark.parametrize("pair", [name for name, r in REFERENCES.items() if r.has_media], indirect=True)
def test_image_token_count_mismatch_is_a_loud_error(pair):
    """One image placeholder fewer than the image's features: refused, both counts named."""
    case = pair.case("one_image")
    image_token = pair.model_cfg.tokens.image_token_id
    input_ids = case.ours["input_ids"].clone()  # [1, s]
    placeholders = int((input_ids == image_token).sum())
    input_ids[input_ids == image_token] = torch.tensor([0] + [image_token] * (placeholders - 1))
    with pytest.raises(ValueError, match=rf"{placeholders - 1} image tokens .* {placeholders} merged patches"):
        pair.model(**dict(case.ours, input_ids=input_ids))


# ---------------------------------------------------------------------------------------------------
# Checks one family proves for the code path it alone has (docs/testing.md names them)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["qwen2_5_vl"], indirect=True)
def test_tied_model_has_no_separate_output_weight(pair):
    model = pair.model
    assert model.language_model.output_layer.weight is None
    assert model.shared_embedding_or_output_weight() is model.language_model.embedding.word_embeddings.weight


# The vision-language references without experts (a routed expert may see no token of a short sample).
EVERY_PARAMETER_TRAINS = ("qwen2_5_vl", "internvl", "llava_onevision")


@pytest.mark.parametrize("pair", EVERY_PARAMETER_TRAINS, indirect=True)
def test_every_parameter_trains(pair):
    """One image's loss reaches every trainable parameter: both towers, the projector, the decoder
    (InternViT's layer scales, class token and positions; LLaVA-OneVision's newline, which only the
    packed features use; its SigLIP post-layernorm is carried frozen, never run)."""
    model = pair.reference.build(pair.model_cfg, ParallelConfig()).train()
    load_hf_state_dict(model, pair.hf_model.state_dict())
    case = pair.case("one_image")
    labels = torch.randint(0, pair.model_cfg.language.vocab_size, case.ours["input_ids"].shape)
    model(**case.ours, labels=labels).mean().backward()
    untouched = [name for name, param in model.named_parameters()
                 if param.requires_grad and (param.grad is None or not param.grad.any())]
    assert not untouched, untouched


@pytest.mark.parametrize("pair", ["qwen2_5_vl"], indirect=True)
def test_runs_under_megatron_schedule(pair):
    """megatron's forward/backward schedule finds what it needs on the model (config, model_type)."""
    mcore_patches.apply_cpu()  # the schedule itself has CUDA-only call sites
    model = pair.reference.build(pair.model_cfg, ParallelConfig()).eval()
    load_hf_state_dict(model, pair.hf_model.state_dict())
    case = pair.case("one_image")
    labels = torch.randint(0, pair.model_cfg.language.vocab_size, case.ours["input_ids"].shape)
    batch = dict(case.ours, labels=labels)

    def forward_step(data_iterator, model):
        loss = model(**next(data_iterator))
        return loss, lambda output: (output.sum(), {"loss_sum": output.sum().detach()})

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=case.length, micro_batch_size=1, forward_only=False,
    )
    with torch.no_grad():
        expected = model(**batch).sum()
    assert torch.allclose(reports[0]["loss_sum"], expected)
    assert model.projector.mlp.linear_fc1.weight.grad is not None


@pytest.mark.parametrize("pair", ["qwen3_vl"], indirect=True)
def test_deepstack_under_activation_recompute(pair):
    """With full recompute the DeepStack features are an input of each checkpoint: the same loss and the
    same gradients, in the vision tower and the DeepStack mergers too."""
    model_cfg, hf_state = pair.model_cfg, pair.hf_model.state_dict()
    case = pair.case("image_and_video")
    ours = case.ours
    position_ids = position_ids_for(model_cfg)(ours["input_ids"][0], ours["media"].grids("image"),
                                               ours["media"].grids("video"))[:, None]
    inputs = dict(ours, position_ids=position_ids)
    labels = torch.randint(0, model_cfg.language.vocab_size, ours["input_ids"].shape)
    results = []
    for recompute in (False, True):
        model = pair.reference.build(model_cfg, ParallelConfig(), recompute_activations=recompute).train()
        assert model.language_model.config.recompute_granularity == ("full" if recompute else None)
        load_hf_state_dict(model, hf_state)
        loss = model(**inputs, labels=labels)
        loss.sum().backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, grads), (recomputed_loss, recomputed_grads) = results
    assert torch.equal(loss, recomputed_loss)
    assert grads.keys() == recomputed_grads.keys()
    assert all(grad.abs().sum() > 0 for name, grad in grads.items() if name.startswith("deepstack_projectors."))
    for name, grad in grads.items():
        assert torch.allclose(grad, recomputed_grads[name], rtol=0, atol=1e-6), name


def test_first_pipeline_stage_must_hold_every_deepstack_layer():
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=4,
                               pipeline_dtype=torch.float32)
    check_pipeline(config, num_deepstack=1)
    with pytest.raises(ValueError, match=r"first pipeline stage must hold at least 2 decoder layers.* holds 1"):
        check_pipeline(config, num_deepstack=2)


@pytest.mark.parametrize("pair", [name for name, r in REFERENCES.items() if r.to_hub_style], indirect=True)
def test_weights_round_trip_to_the_hub_key_style(pair):
    """Every HF tensor is read (both key styles) and written back unchanged, in the Hub's style."""
    model_cfg, model = pair.model_cfg, pair.model
    expected = pair.reference.to_hub_style(pair.hf_model.state_dict())
    if model_cfg.language.tie_word_embeddings:
        expected.pop("lm_head.weight")
    written = megatron_to_hf([model.state_dict()], model_cfg)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[key], expected[key]) for key in expected)
    hub_loaded = pair.reference.build(model_cfg, ParallelConfig()).eval()
    load_hf_state_dict(hub_loaded, expected)
    assert all(torch.equal(a, b) for a, b in zip(hub_loaded.state_dict().values(), model.state_dict().values())
               if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("pair", [name for name, r in REFERENCES.items() if not r.has_media], indirect=True)
def test_text_only_model_refuses_media(pair):
    case = pair.case("text", text_len=4)
    with pytest.raises(ValueError, match="a text-only model takes no images or videos"):
        pair.model(**case.ours, media=MediaBatch.of(pixel_values=torch.zeros(4, 8),
                                                    image_grid_thw=torch.tensor([[1, 2, 2]])))


# ---------------------------------------------------------------------------------------------------
# Mixture of experts: megatron-core's MoE layer, transformers' balance loss, the experts' weight layouts
# ---------------------------------------------------------------------------------------------------

MOE_CASES = ("text", "one_image", "image_and_video")
AUX_TOLERANCE = 1e-6


@pytest.mark.parametrize("pair", ["qwen3_vl_moe"], indirect=True)
def test_decoder_layers_are_megatrons_moe_layers_with_deepstack_hooks(pair):
    layers = pair.model.language_model.decoder.layers
    assert all(isinstance(layer.mlp, MoELayer) for layer in layers)
    assert len(layers[0].mlp.experts.local_experts) == pair.model_cfg.language.moe.num_experts
    hooked = [bool(layer._forward_hooks) for layer in layers]
    assert hooked == [index < TINY_VISION.num_deepstack_layers for index in range(len(layers))]


@pytest.mark.parametrize("pair", ["qwen3_vl_moe"], indirect=True)
def test_router_statistics_give_transformers_aux_loss(pair):
    """Every token (text, image and video placeholders alike) goes through every router on both sides;
    transformers averages the statistics over layers before taking the product. Only the renormalised
    router: transformers' Qwen3-VL-MoE has no other (the unnormalised one is ``qwen3_moe_unnormalised``'s
    logits above)."""
    for layout in MOE_CASES:
        case = pair.case(layout)
        with torch.no_grad():
            expected = pair.hf_model(**case.theirs, output_router_logits=True).aux_loss
            with RouterStatistics(pair.model).record() as recorded:
                pair.model(**case.ours)
        assert len(recorded.statistics) == pair.model_cfg.language.num_layers
        diff = abs(float(transformers_balance_loss(recorded.statistics)) - float(expected))
        print(f"\n{layout}: aux loss {float(expected):.6f}, diff {diff:.3e}")
        assert diff <= AUX_TOLERANCE, layout


@pytest.mark.parametrize("pair", ["qwen3_vl_moe"], indirect=True)
def test_router_statistics_give_megatrons_per_layer_losses(pair):
    """In training megatron-core adds each layer's own loss (``moe_balance`` says how it differs)."""
    model = pair.reference.build(pair.model_cfg, ParallelConfig()).train()
    load_hf_state_dict(model, pair.hf_model.state_dict())
    case = pair.case("one_image")
    clear_aux_losses_tracker()
    with RouterStatistics(model).record() as recorded:
        model(**case.ours)
    per_layer = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]  # aux / coeff
    ours = megatron_balance_loss(recorded.statistics, pair.model_cfg.language.moe.router_topk)
    assert abs(float(per_layer.sum()) - float(ours)) <= AUX_TOLERANCE
    clear_aux_losses_tracker()


def _hub_layout(hf_state: dict) -> dict:
    """The Hub's Qwen3-VL-MoE files: fused expert tensors with their two trailing axes swapped."""
    return {key: value.transpose(1, 2).contiguous() if key.endswith((".experts.gate_up_proj", ".experts.down_proj"))
            else value for key, value in hf_state.items()}


@pytest.mark.parametrize("pair", ["qwen3_vl_moe"], indirect=True)
def test_the_hubs_transposed_expert_layout_reads_the_same(pair):
    """transformers 5 writes the fused experts [E, 2 x ffn, h]; a state dict in the Hub's transposed layout
    loads into the same weights (the round trip itself is test_weights_round_trip_to_the_hub_key_style's)."""
    hf_state = pair.hf_model.state_dict()
    written = megatron_to_hf([pair.model.state_dict()], pair.model_cfg)
    assert written["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 48, 64)
    from_hub = pair.reference.build(pair.model_cfg, ParallelConfig()).eval()
    hub_state = _hub_layout(hf_state)
    assert hub_state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 2 * 48)
    load_hf_state_dict(from_hub, hub_state)
    ours = {k: v for k, v in pair.model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(v, ours[k]) for k, v in from_hub.state_dict().items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("pair", ["qwen3_vl_moe"], indirect=True)
def test_an_expert_parallel_rank_takes_its_experts_from_the_fused_tensors(pair):
    """With EP 2, rank 1 holds experts 2 and 3 as its local experts 0 and 1 (``ExpertPlacement``)."""
    full = pair.model.state_dict()
    local = {0: 2, 1: 3}
    keys = [k for k in full if any(f".local_experts.{e}." in k for e in local)]
    second_rank = hf_to_megatron(pair.hf_model.state_dict(), pair.model_cfg, keys,
                                 experts=ExpertPlacement(offset=2, tp_rank=0, tp_size=1))
    assert len(second_rank) == 2 * 2 * pair.model_cfg.language.num_layers  # fc1 and fc2 of 2 experts a layer
    for key, tensor in second_rank.items():
        e = next(e for e in local if f".local_experts.{e}." in key)
        assert torch.equal(tensor, full[key.replace(f".local_experts.{e}.", f".local_experts.{local[e]}.")]), key


@pytest.mark.parametrize("pair", ["qwen3_moe", "qwen3_moe_unnormalised"], indirect=True)
def test_text_moe_is_megatrons_moe_layer(pair):
    for layer in pair.model.language_model.decoder.layers:
        assert isinstance(layer.mlp, MoELayer) and isinstance(layer.mlp.experts, SequentialMLP)
        assert isinstance(layer.mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
        assert layer.mlp.router.topk == pair.model_cfg.language.moe.router_topk == 2
        assert len(layer.mlp.experts.local_experts) == pair.model_cfg.language.moe.num_experts == 4


@pytest.mark.parametrize("pair", ["qwen3_moe"], indirect=True)
def test_text_moe_weights_round_trip_through_megatron_bit_exact(pair, tmp_path):
    """transformers 5's fused experts -> megatron's per-expert linears -> the Hub layout (one tensor per
    expert), which transformers loads back into the very same fused tensors. The unnormalised router's
    weights are the same tensors: ``qwen3_moe`` proves it once."""


    hub = megatron_to_hf([pair.model.state_dict()], pair.model_cfg)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in hub and "model.layers.0.mlp.gate.weight" in hub
    assert {k: tuple(v.shape) for k, v in hub.items()} == get_family("llm").hf_shapes(pair.model_cfg)
    pair.hf_model.save_pretrained(tmp_path)  # the config; the weights are replaced by ours below
    for stale in tmp_path.glob("*.safetensors*"):
        stale.unlink()
    save_file({k: v.contiguous() for k, v in hub.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    original = pair.hf_model.state_dict()
    assert sorted(reloaded) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(reloaded[key], tensor), key
