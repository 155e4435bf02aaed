"""Tensor parallel size 2 equals transformers, every registered reference (``TP_REFERENCES``), without
and with sequence parallelism, in ONE launch of two forked gloo ranks (the worker loops over the
references): logits and the per-token loss (whole and loss-masked) on text, two images and a video where
the family has media, and on a packed (thd) row of three samples. Where a weight is split or shared over
the ranks in a way the logits alone could hide, its gradient after one backward equals transformers'
(Qwen3's q/k norm: each rank's part sums to it; DeepSeek's latent down-projection: rows split, the rotary
key's last). Family checks of the same launch: every tower's layers split at vision TP 2; Qwen2.5-VL's
vision TP 1 beside language TP 2; Qwen3-VL's and Qwen3.5's shards convert back to the transformers weights
bit for bit and a distributed checkpoint records the whole shapes; Qwen3-MoE loaded from ``loongforge
convert``'s TP-2 checkpoint, and its balance-loss gradient equals one process's (megatron-core alone would
divide it by the TP size: ``moe_balance``). The chunked LM head and cross-entropy (``training.loss_chunk_tokens``)
equal the whole logits' at TP 2, with and without sequence parallelism: loss and every gradient.

The worker builds the references itself (seeded, so both ranks build the same) and returns only the
measured figures; rank 0 runs transformers."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter

from loongforge.config.schema import ParallelConfig
from loongforge.convert.engine import hf_to_mcore
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.train.checkpoint import load_checkpoint
from loongforge.train.runner import wrap_for_training
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.llm_helpers import answer_masked_row, expected_balance_grad, router_grad
from tests.models.references import REFERENCES, even_length, packed, reference_logits

WORLD_SIZE = 2
TIMEOUT_S = 600  # one launch for every reference: about 40 s on 2 idle cores
BALANCE_COEFFICIENT = 0.5
# Left out, as TP splits nothing another reference's run does not: Qwen3-MoE's unnormalised router (its
# math is TP 1's to prove; the experts split as the normalised one's) and Qwen3-VL-MoE (experts in a
# vision-language model at TP 2: Qwen3.5-MoE's, which adds a gated shared expert).
TP_REFERENCES = [name for name in REFERENCES if name not in ("qwen3_moe_unnormalised", "qwen3_vl_moe")]
# At TP 2 the layouts that split differently: text, images, a video where the family has one (one image, and
# an image with a video in one sample, are TP 1's; the packed row holds the images and the video in one forward).
TP_LAYOUTS = ("text", "two_images", "video")
# Layouts: (sequence parallel, vision TP size (None: the language TP), weights from convert's checkpoint).
LAYOUTS = {"tp": (False, None, False), "tp+sp": (True, None, False)}
# Vision TP 1 beside language TP 2 (a replicated encoder handing its features to the split decoder: the
# composition's code, whatever the tower, whose TP 1 forward test_parity proves): Qwen2.5-VL's.
EXTRA_LAYOUTS = {"qwen2_5_vl": {"tp, vision tp 1": (False, 1, False)},
                 "qwen3_moe": {"tp+sp, converted": (True, None, True)}}
# The gradient checks: (our weight, transformers' weight, how the ranks' parts make the whole, relative).
GRAD_PROBES = {
    # Each rank normalises its own heads with the one shared weight: the two ranks' parts add up to
    # transformers' gradient (megatron all-reduces them in finalize_model_grads).
    "qwen3": (lambda m: m.language_model.decoder.layers[0].self_attention.q_layernorm.weight,
              lambda hf: hf.model.layers[0].self_attn.q_norm.weight, "sum", False),
    # The latent down-projection's rows split over TP; the rotary rows (the last 8) took only one rank's
    # heads' share before mcore_patches.mla_rotary_scope.
    **{arch: (lambda m: m.language_model.decoder.layers[0].self_attention.linear_kv_down_proj.weight,
              lambda hf: hf.model.layers[0].self_attn.kv_a_proj_with_mqa.weight, "cat", True)
       for arch in ("deepseek_v3", "deepseek_v2")},
    # The key norm over all key heads: each rank holds its heads' channels of the weight, its statistics summed
    # over TP (whose backward sums too): the two parts side by side are transformers' gradient.
    "minimax_m2": (lambda m: m.language_model.decoder.layers[0].self_attention.k_layernorm.weight,
                   lambda hf: hf.model.layers[0].self_attn.k_norm.weight, "cat", False),
}
# The chunked loss against the whole logits at TP 2 (the vocabulary split, its padding on rank 1 alone): Qwen2's
# untied head (the tied one's split is the same rows of the embedding), 4 tokens a chunk.
CHUNKED_REFERENCE, CHUNK_TOKENS = "qwen2", 4
# Whole shapes a distributed checkpoint records for column-parallel weights (so it reshards).
SHARDED_SHAPES = {
    "qwen3_vl": {
        "vision_model.layers.0.mlp.linear_fc1.weight": (64, 32),
        "projector.mlp.linear_fc1.weight": (128, 128),
        "deepstack_projectors.1.mlp.linear_fc1.weight": (128, 128),
        # megatron stacks the decoder layers: [layers, out, in]
        "language_model.decoder.layers.0.self_attention.linear_qkv.weight": (3, 4 * 32 + 2 * 2 * 32, 64),
    },
    # A linear-attention layer (0): the projection's 2 key-head groups of [q 32, k 32, v 2x32, z 2x32, b 2,
    # a 2] rows, the convolution's groups of [q, k, v] channels, one decay per value head; the gated
    # attention (3): 2 groups of [2 q, 2 gates, k, v].
    "qwen3_5": {
        "language_model.decoder.layers.0.self_attention.in_proj.weight": (2 * (32 + 32 + 64 + 64 + 2 + 2), 128),
        "language_model.decoder.layers.0.self_attention.conv1d.weight": (2 * (32 + 32 + 64), 1, 4),
        "language_model.decoder.layers.0.self_attention.A_log": (4,),
        "language_model.decoder.layers.0.self_attention.out_proj.weight": (128, 128),
        "language_model.decoder.layers.3.self_attention.linear_qkv.weight": (2 * (2 + 2 + 1 + 1) * 64, 128),
    },
}
SHARDED_SHAPES["qwen3_5_moe"] = SHARDED_SHAPES["qwen3_5"]


def _cases(reference, model_cfg, hf_model) -> tuple[dict, list]:
    """Each layout at an even length (sequence parallelism halves it), then a packed row of three
    samples; and the three samples."""
    cases = {name: even_length(reference, model_cfg, hf_model, **layout)
             for name, layout in reference.layouts.items() if name in TP_LAYOUTS}
    if reference.has_media:
        parts = [cases[name] for name in ("two_images", "video", "text") if name in cases]
    else:
        parts = [reference.sample(model_cfg, hf_model, seed=seed, text_len=length)
                 for seed, length in ((1, 12), (2, 8), (3, 20))]
    cases["packed"] = packed(parts)
    return cases, parts


def _expected_logits(hf_model, cases: dict, parts: list) -> dict:
    """transformers' logits [1, s, V] of each case; the packed row's: its samples' run alone."""
    expected = {name: reference_logits(hf_model, case) for name, case in cases.items() if name != "packed"}
    expected["packed"] = torch.cat([reference_logits(hf_model, part) for part in parts], dim=1)
    return expected


def _targets(cases: dict, vocab: int) -> dict:
    """Random labels and loss mask [1, s] of each case."""
    generator = torch.Generator().manual_seed(3)
    targets = {}
    for name, case in cases.items():
        shape = case.ours["input_ids"].shape
        targets[name] = (torch.randint(0, vocab, shape, generator=generator),
                         (torch.rand(shape, generator=generator) < 0.5).float())
    return targets


def _gathered_logits(logits: torch.Tensor) -> torch.Tensor:
    shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]  # [1, s, V/2] each
    dist.all_gather(shards, logits.contiguous())
    return torch.cat(shards, dim=-1)


def _check_cases(reference, model, cases, targets, expected, vocab, is_first: bool) -> dict:
    figures = {}
    for case_name, case in cases.items():
        labels, loss_mask = targets[case_name]
        with torch.no_grad():
            logits = _gathered_logits(model(**case.ours))
            loss = model(**case.ours, labels=labels)  # [1, s]: every position
            masked = model(**case.ours, labels=labels, loss_mask=loss_mask)  # the head on picked positions only
        if is_first:
            picked = loss_mask[0].bool()
            reference_loss = F.cross_entropy(expected[case_name][0], labels[0], reduction="none")
            figures[case_name] = dict(logits=reference.difference(logits[..., :vocab], expected[case_name]),
                                      loss=max(reference.difference(loss[0], reference_loss),
                                               reference.difference(masked[0][picked], reference_loss[picked])),
                                      masked_zero=bool((masked[0][~picked] == 0).all()))
    return figures


def _grad_probe(name, model, hf_model, case, labels, is_first: bool):
    """(difference from transformers' gradient, whether the ranks' parts differ)."""
    ours_of, theirs_of, combine, relative = GRAD_PROBES[name]
    loss = model(**case.ours, labels=labels)
    loss.sum().backward()
    weight = ours_of(model)
    grad = weight.main_grad if getattr(weight, "main_grad", None) is not None else weight.grad
    parts = [torch.empty_like(grad) for _ in range(WORLD_SIZE)]
    dist.all_gather(parts, grad.contiguous())
    model.zero_grad()
    if not is_first:
        return None
    hf_model.zero_grad()
    F.cross_entropy(hf_model(**case.theirs).logits[0], labels[0], reduction="none").sum().backward()
    expected = theirs_of(hf_model).grad
    whole = torch.cat(parts, dim=0) if combine == "cat" else parts[0] + parts[1]
    diff = float((whole - expected).abs().max())
    return (diff / float(expected.abs().max()) if relative else diff), not torch.allclose(parts[0], parts[1])


def _written(model, model_cfg, name, hf_model, is_first: bool) -> dict:
    """Both ranks' shards back to transformers' tensors, and the whole shapes a checkpoint records."""
    shards = [None] * WORLD_SIZE
    dist.all_gather_object(shards, model.state_dict())
    sharded = model.sharded_state_dict()
    if not is_first:
        return {}
    expected = REFERENCES[name].to_hub_style(hf_model.state_dict())
    if model_cfg.language.tie_word_embeddings:
        expected.pop("lm_head.weight")
    written = megatron_to_hf(shards, model_cfg)
    return dict(written=written.keys() == expected.keys() and all(torch.equal(written[k], expected[k])
                                                                  for k in expected),
                global_shapes={key: tuple(sharded[key].global_shape) for key in SHARDED_SHAPES[name]})


def _balance_grad(reference, model_cfg, hf_model, rank: int):
    """The last router's balance-loss gradient after one training step (TP 2 with SP: megatron-core trains
    MoE at TP > 1 only with it), minus the same from transformers' last router input on one process."""
    parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE, sequence_parallel=True)
    model = reference.build(model_cfg, parallel_cfg)
    load_hf_state_dict(model, hf_model.state_dict())
    chunks, _ = wrap_for_training(model.train(), parallel_cfg)
    router = [m for m in model.modules() if isinstance(m, TopKRouter)][-1]
    rows = [answer_masked_row(32, 32 // 3, seed=3, packed=False)]
    with_balance, _ = router_grad(chunks, router, rows, BALANCE_COEFFICIENT, rank == 0)
    without_balance, _ = router_grad(chunks, router, rows, 0.0, rank == 0)
    if rank != 0:
        return None
    gate = hf_model.model.layers[-1].mlp.gate
    inputs = []
    handle = gate.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
    with torch.no_grad():
        hf_model(input_ids=rows[0]["input_ids"])
    handle.remove()
    expected = expected_balance_grad(gate.weight, inputs, hf_model.config.num_experts_per_tok, BALANCE_COEFFICIENT)
    return float((with_balance - without_balance - expected).abs().max() / expected.abs().max())


def _chunked_loss_difference(reference, model_cfg, parallel_cfg, hf_model, case) -> float:
    """The largest difference over the ranks of the loss (loss-masked and every position) and of every
    parameter's gradient of the step's objective (the mean over loss tokens), chunked vs the whole logits."""
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, model_cfg.language.vocab_size, case.ours["input_ids"].shape, generator=generator)
    loss_mask = (torch.rand(labels.shape, generator=generator) < 0.6).float()
    runs = []
    for chunk_tokens in (0, CHUNK_TOKENS):
        model = reference.build(model_cfg, parallel_cfg, loss_chunk_tokens=chunk_tokens).train()
        load_hf_state_dict(model, hf_model.state_dict())
        losses = []
        for mask in (loss_mask, None):
            loss = model(**case.ours, labels=labels, loss_mask=mask)  # [1, s]
            weights = torch.ones_like(loss) if mask is None else mask
            ((loss * weights).sum() / weights.sum()).backward()
            losses.append(loss.detach())
        runs.append((losses, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (losses, grads), (chunked_losses, chunked_grads) = runs
    assert grads.keys() == chunked_grads.keys() and grads
    difference = torch.tensor(max([float((a - b).abs().max()) for a, b in zip(losses, chunked_losses)]
                                  + [float((grads[name] - chunked_grads[name]).abs().max()) for name in grads]))
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return float(difference)


def _worker(rank: int, port: int, workdir: str) -> None:
    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    is_first = rank == 0
    results = {}
    for name in TP_REFERENCES:
        reference = REFERENCES[name]
        model_cfg = reference.model_cfg()
        hf_model = reference.hf_model(model_cfg)
        vocab = model_cfg.language.vocab_size
        cases, parts = _cases(reference, model_cfg, hf_model)
        targets = _targets(cases, vocab)
        expected = _expected_logits(hf_model, cases, parts) if is_first else None
        for layout, (sequence_parallel, vision_tp, converted) in {**LAYOUTS, **EXTRA_LAYOUTS.get(name, {})}.items():
            parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                          sequence_parallel=sequence_parallel,
                                          vision_tensor_model_parallel_size=vision_tp)
            model = reference.build(model_cfg, parallel_cfg).eval()
            if converted:
                load_checkpoint(Path(workdir) / name, [model], optimizer=None, scheduler=None)
            else:
                load_hf_state_dict(model, hf_model.state_dict())
            results[name, layout] = _check_cases(reference, model, cases, targets, expected, vocab, is_first)
            if name in GRAD_PROBES and not converted:
                results[name, layout, "grad"] = _grad_probe(name, model, hf_model, cases["text"],
                                                            targets["text"][0], is_first)
            if name == CHUNKED_REFERENCE:
                results[name, layout, "chunked"] = _chunked_loss_difference(reference, model_cfg, parallel_cfg,
                                                                            hf_model, cases["text"])
            if name in SHARDED_SHAPES and layout == "tp":
                results[name, "written"] = _written(model, model_cfg, name, hf_model, is_first)
            if reference.has_media:
                vision_layer = model.vision_model.layers[0]
                results[name, layout, "vision"] = (vision_layer.pg_collection.tp.size(),
                                                   bool(vision_layer.mlp.linear_fc1.weight.tensor_model_parallel))
        if name == "qwen3_moe":
            results[name, "balance"] = _balance_grad(reference, model_cfg, hf_model, rank)
    if is_first:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def test_tp2_with_and_without_sequence_parallelism_matches_transformers(tmp_path):
    reference = REFERENCES["qwen3_moe"]
    reference.hf_model(reference.model_cfg()).save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "qwen3_moe", tp=WORLD_SIZE, progress=False)

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    results = torch.load(tmp_path / "outputs.pt", weights_only=False)
    failures = []
    for name in TP_REFERENCES:
        reference = REFERENCES[name]
        unit = " of the largest" if reference.relative else ""
        for layout in {**LAYOUTS, **EXTRA_LAYOUTS.get(name, {})}:
            figures = results[name, layout]
            worst = max(f["logits"] for f in figures.values())
            worst_loss = max(f["loss"] for f in figures.values())
            print(f"\n{name} TP 2 {layout}: logits within {worst:.1e}{unit}, loss {worst_loss:.1e}{unit} "
                  f"({len(figures)} cases)", end="")
            for case, f in figures.items():
                if not (f["logits"] <= reference.tolerance and f["loss"] <= reference.tolerance and f["masked_zero"]):
                    failures.append((name, layout, case, f))
            if (name, layout, "grad") in results:
                diff, parts_differ = results[name, layout, "grad"]
                print(f"; probed gradient {diff:.1e}", end="")
                if diff > 1e-5 or (GRAD_PROBES[name][2] == "sum" and not parts_differ):
                    failures.append((name, layout, "grad", diff, parts_differ))
    print()
    assert not failures, failures
    # Every tower's layers split at vision TP 2.
    towers = {name: results[name, "tp", "vision"] for name in TP_REFERENCES if REFERENCES[name].has_media}
    assert set(towers.values()) == {(2, True)}, towers
    assert results["qwen2_5_vl", "tp, vision tp 1", "vision"] == (1, False)
    for name in SHARDED_SHAPES:
        assert results[name, "written"]["written"], name
        assert results[name, "written"]["global_shapes"] == SHARDED_SHAPES[name], name
    for layout in LAYOUTS:
        chunked = results[CHUNKED_REFERENCE, layout, "chunked"]
        print(f"{CHUNKED_REFERENCE} TP 2 {layout}: the loss in chunks of {CHUNK_TOKENS} tokens vs the whole logits, "
              f"loss and every gradient within {chunked:.1e}")
        assert chunked <= 1e-6
    print(f"qwen3_moe balance-loss gradient at TP 2 + SP vs one process: {results['qwen3_moe', 'balance']:.1e} "
          "of the largest")
    assert results["qwen3_moe", "balance"] <= 1e-5
