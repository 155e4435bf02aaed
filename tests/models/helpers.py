"""Shared test helpers: the tiny preset, a matching random transformers model, sample inputs,
megatron parallel-state setup over gloo (usable in-process and in worker processes), and
``run_workers``, which forks test workers from one fork server per test session."""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from multiprocessing import reduction
from typing import Optional

import pytest
import torch

from loongforge.models.media import MediaBatch, MediaSet
import torch.distributed as dist

from loongforge.config.schema import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig, WindowAttentionConfig
from loongforge.parallel import fork_server
from loongforge.parallel.launch_env import free_port  # noqa: F401  (tests import it from here)

# Channels * temporal patch * patch^2: the width of one row of pixel_values.
PATCH_DIM = 3 * 2 * 14 * 14


def tiny_model_cfg(*, tie: bool = True, num_layers: int = 2) -> ModelConfig:
    """The shipped tiny preset's dims (language depth reduced for speed)."""
    return ModelConfig(
        family="qwen2_5_vl",
        vision=VisionConfig(
            arch="qwen2_5_vit", depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=14,
            temporal_patch_size=2, window=WindowAttentionConfig(size=112, fullatt_block_indexes=[1]),
        ),
        projector=ProjectorConfig(spatial_merge_size=2, out_hidden_size=128),
        language=LanguageConfig(
            num_layers=num_layers, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
            num_query_groups=2, vocab_size=151936, rope_theta=1e6, mrope_section=[4, 6, 6],
            tie_word_embeddings=tie,
        ),
        layer_backend="sdpa",
    )


def hf_config(model_cfg: ModelConfig):
    from transformers import Qwen2_5_VLConfig

    vis, lang, tok = model_cfg.vision, model_cfg.language, model_cfg.tokens
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=lang.vocab_size, hidden_size=lang.hidden_size,
            intermediate_size=lang.ffn_hidden_size, num_hidden_layers=lang.num_layers,
            num_attention_heads=lang.num_attention_heads, num_key_value_heads=lang.num_query_groups,
            rms_norm_eps=lang.rms_norm_eps, max_position_embeddings=lang.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": lang.rope_theta,
                             "mrope_section": list(lang.mrope_section)},
        ),
        vision_config=dict(
            depth=vis.depth, hidden_size=vis.hidden_size, intermediate_size=vis.intermediate_size,
            num_heads=vis.num_heads, in_channels=vis.in_channels, patch_size=vis.patch_size,
            temporal_patch_size=vis.temporal_patch_size, window_size=vis.window.size,
            fullatt_block_indexes=list(vis.window.fullatt_block_indexes),
            spatial_merge_size=model_cfg.projector.spatial_merge_size,
            out_hidden_size=model_cfg.projector.out_hidden_size,
            tokens_per_second=model_cfg.tokens_per_second, hidden_act=vis.hidden_act,
        ),
        image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id, vision_end_token_id=tok.vision_end_token_id,
        tie_word_embeddings=lang.tie_word_embeddings,
    )


def build_hf_model(model_cfg: ModelConfig, seed: int = 0):
    """A random fp32 transformers Qwen2.5-VL; every parameter (norms and biases too) randomised so
    that a wrong mapping of any tensor shows up in the logits."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(hf_config(model_cfg)).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name or "ln_q" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.05 * noise)
    return model


@dataclasses.dataclass
class Sample:
    input_ids: torch.Tensor  # [1, s]
    mm_token_type_ids: torch.Tensor  # [1, s]: 0 text, 1 image, 2 video
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    pixel_values_videos: Optional[torch.Tensor] = None
    video_grid_thw: Optional[torch.Tensor] = None


def make_sample(
    model_cfg: ModelConfig,
    *,
    text_len: int = 12,
    images: tuple[tuple[int, int, int], ...] = (),
    videos: tuple[tuple[int, int, int], ...] = (),
    seed: int = 0,
    patch_dim: int = PATCH_DIM,
    text_vocab: int = 150000,
) -> Sample:
    """Text (ids below ``text_vocab``), then each image/video as <vision_start> pad*n <vision_end>,
    then more text; pixel rows of ``patch_dim`` values."""
    g = torch.Generator().manual_seed(seed)
    tok, merge_unit = model_cfg.tokens, model_cfg.projector.spatial_merge_size**2
    ids, types = [torch.randint(0, text_vocab, (text_len,), generator=g)], [torch.zeros(text_len, dtype=torch.long)]
    pixels = {"image": [], "video": []}
    for kind, grids, token_id, type_id in (("image", images, tok.image_token_id, 1), ("video", videos, tok.video_token_id, 2)):
        for t, h, w in grids:
            n = t * h * w // merge_unit
            ids += [torch.tensor([tok.vision_start_token_id]), torch.full((n,), token_id), torch.tensor([tok.vision_end_token_id])]
            types += [torch.zeros(1, dtype=torch.long), torch.full((n,), type_id), torch.zeros(1, dtype=torch.long)]
            pixels[kind].append(torch.randn(t * h * w, patch_dim, generator=g))
    ids.append(torch.randint(0, text_vocab, (5,), generator=g))
    types.append(torch.zeros(5, dtype=torch.long))
    grid = lambda gs: torch.tensor(gs, dtype=torch.long) if gs else None  # noqa: E731
    cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
    return Sample(
        input_ids=torch.cat(ids)[None],
        mm_token_type_ids=torch.cat(types)[None],
        pixel_values=cat(pixels["image"]),
        image_grid_thw=grid(images),
        pixel_values_videos=cat(pixels["video"]),
        video_grid_thw=grid(videos),
    )


def hf_position_ids(hf_model, sample: Sample) -> torch.Tensor:
    """[3, 1, s] M-RoPE positions from transformers' own get_rope_index."""
    positions, _ = hf_model.model.get_rope_index(
        sample.input_ids, sample.mm_token_type_ids,
        image_grid_thw=sample.image_grid_thw, video_grid_thw=sample.video_grid_thw,
    )
    return positions


@torch.no_grad()
def hf_logits(hf_model, sample: Sample) -> torch.Tensor:
    """[1, s, V] logits of the transformers model."""
    return hf_model(
        input_ids=sample.input_ids,
        position_ids=hf_position_ids(hf_model, sample),
        pixel_values=sample.pixel_values,
        image_grid_thw=sample.image_grid_thw,
        pixel_values_videos=sample.pixel_values_videos,
        video_grid_thw=sample.video_grid_thw,
    ).logits


def sample_media(sample: Sample) -> MediaBatch:
    """The sample's images and videos as the model takes them."""
    return MediaBatch.of(pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw,
                         pixel_values_videos=sample.pixel_values_videos, video_grid_thw=sample.video_grid_thw)


def our_inputs(sample: Sample, position_ids: torch.Tensor) -> dict:
    return dict(input_ids=sample.input_ids, position_ids=position_ids, media=sample_media(sample))


def cat_media(batches: list[MediaBatch]) -> MediaBatch:
    """Several samples' media as one packed row's: each modality's items one after another."""
    def cat_set(sets):
        sets = [m for m in sets if m is not None]
        if not sets:
            return None
        def cat(name):
            parts = [getattr(m, name) for m in sets]
            return None if any(part is None for part in parts) else torch.cat(parts)
        facts = {name: torch.cat([m.facts[name] for m in sets]) for name in sets[0].facts}
        return MediaSet(grids=cat("grids"), rows=cat("rows"), features=cat("features"), sizes=cat("sizes"),
                        facts=facts)
    return MediaBatch(images=cat_set([b.images for b in batches]), videos=cat_set([b.videos for b in batches]))


# ---------------------------------------------------------------------------------------------
# megatron parallel state over gloo
# ---------------------------------------------------------------------------------------------


def init_megatron(rank: int, world_size: int, port: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
                  vp: Optional[int] = None, seed: int = 1234) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp)
    # The CPU-safe form (docs/megatron-cpu.md): a plain model_parallel_cuda_manual_seed needs CUDA.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def destroy_megatron() -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    # megatron-core's per-layer MoE loss tracker is a process global sized by the first model's
    # layer count: the next test's model may have another.
    get_moe_layer_wise_logging_tracker().clear()
    # So is the aux-loss backward scale: a backward run outside megatron's schedule (the FLOP
    # counting tests) creates it as a 0-d tensor, which the schedule's [1]-shaped scale then
    # cannot be copied into.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def limit_threads() -> None:
    """Two worker processes on two cores: one intra-op thread each avoids oversubscription."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


# What the fork server of ``run_workers`` imports once per session, so that a worker group only
# forks (a spawned worker paid a fresh interpreter, torch, megatron-core and the model code, seconds
# of CPU each, ~50 groups in the suite): the training code, with megatron-core (loongforge's import
# installs its deferred jit first) and every model family; what workers import lazily (torch._dynamo
# when they build an optimizer, transformers' models for parity); these helpers.
WORKER_PRELOAD = ("loongforge.parallel.quiet_known_warnings", "loongforge.train.runner", "torch._dynamo",
                  "transformers.modeling_utils", __name__)


class _CallersStdio:
    """The caller's stdout and stderr, handed to a forked worker as file descriptors: the fork
    server's own are those of the test it was started in (pytest captures each test's output apart),
    and a spawned worker had its caller's."""

    def __reduce__(self):
        return _use_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _use_stdio(stdout, stderr) -> None:
    os.dup2(stdout.detach(), 1)
    os.dup2(stderr.detach(), 2)


def _forked_worker(rank: int, worker, environ: dict[str, str], _stdio: None, *args) -> None:
    """In a worker forked by the session's fork server: the caller's environment (the server's is
    the one it started with), tied to the server's life, then ``worker(rank, *args)``."""
    os.environ.clear()
    os.environ.update(environ)
    fork_server.die_with_parent(os.getppid())  # a killed test session leaves no worker behind
    worker(rank, *args)


def run_workers(worker, nprocs: int, args: tuple, timeout_s: float) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` forked processes; re-raise a worker's error; kill all
    and fail when they are not done within ``timeout_s`` (so a hung collective cannot hang CI).

    ``worker`` must be importable by its qualified name (a module-level function of a test module):
    the worker process imports its module, as a spawned one did."""
    fork_server.ensure(WORKER_PRELOAD)
    context = torch.multiprocessing.start_processes(
        _forked_worker, args=(worker, dict(os.environ), _CallersStdio(), *args), nprocs=nprocs, join=False,
        start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises if a worker failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} workers did not finish within {timeout_s} s")
