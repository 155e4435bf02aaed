"""Exchange-mode balancing over gloo (data.read=sharded): each rank loads its own share, the
ranks gather sizes and move samples. Checked against the same sharded reading without balancing:
every step trains the same multiset of samples, each sample with its own pixels."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.models.helpers import free_port, limit_threads, run_workers

STEPS = 4
SEQ_LEN = 384


def _data_cfg(source: str, paths: list[str]):
    from loongforge.config.schema import DataConfig

    return DataConfig(source=source, paths=paths, synthetic_num_samples=400, seq_len=SEQ_LEN, seed=5,
                      max_pixels=12544, read="sharded", num_workers=1)


def _image_pad_runs(input_ids: torch.Tensor, pad_id: int) -> list[int]:
    """Lengths of the consecutive runs of image pad tokens, in order: one run per image."""
    runs, count = [], 0
    for token in input_ids.tolist() + [-1]:
        if token == pad_id:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    return runs


def _media_chunks(media) -> list[float]:
    """Checksum of each image's (or video's) pixel rows, in token order."""
    if media is None:
        return []
    return [round(float(c.double().sum()), 3) for c in torch.split(media.rows, media.patches)]


def _per_sample(micro_batch: dict, tokens, merge: int) -> list[tuple]:
    """(sample_id, length, pixel checksums of its images, of its videos) per sample: what must
    travel together. Each image's / video's pixels must sit next to its own pad tokens."""
    ids = micro_batch["input_ids"][0]  # [T]
    cu = micro_batch["cu_seqlens"].tolist()
    out, used = [], {"image": 0, "video": 0}
    batch = micro_batch["media"]
    media = {"image": (tokens.image_token_id, batch.grids("image"), _media_chunks(batch.images)),
             "video": (tokens.video_token_id, batch.grids("video"), _media_chunks(batch.videos))}
    for k, sample_id in enumerate(micro_batch["sample_ids"]):
        sums = []
        for kind, (pad_id, grids, chunks) in media.items():
            runs = _image_pad_runs(ids[cu[k]:cu[k + 1]], pad_id)
            first = used[kind]
            sample_grids = grids[first:first + len(runs)].tolist() if runs else []
            assert runs == [t * h * w // merge ** 2 for t, h, w in sample_grids], (sample_id, kind)
            sums.append(tuple(chunks[first:first + len(runs)]))
            used[kind] += len(runs)
        out.append((sample_id, cu[k + 1] - cu[k], *sums))
    return out


def _worker(rank: int, world: int, port: int, layout: tuple[int, int], source: str, paths: list[str],
            out_dir: str, data_overrides: dict) -> None:
    """``layout`` = (tp, pp); rank = dp * tp * pp + pp_rank * tp + tp_rank."""
    from loongforge.config.schema import BalanceConfig, ModelConfig
    from loongforge.data.pipeline import DataPipeline
    from loongforge.data.tokenizer import load_tokenizer
    from loongforge.parallel.data_groups import build_data_groups

    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp, pp = layout
    dp_size = world // (tp * pp)
    dp_rank, within = divmod(rank, tp * pp)
    pp_rank, tp_rank = divmod(within, tp)
    tokenizer = load_tokenizer("qwen")
    model = ModelConfig(family="qwen2_5_vl")
    results = {}
    for name, balance in (("balanced", BalanceConfig(enabled=True, threshold=0.0)), ("plain", None)):
        groups = build_data_groups(tp_rank, pp_rank, dp_rank)  # fresh groups per pipeline
        pipeline = DataPipeline(replace(_data_cfg(source, paths), **data_overrides), model, global_batch_size=2 * dp_size,
                                dp_rank=dp_rank, dp_size=dp_size, pad_to_multiple=8, tokenizer=tokenizer,
                                balance_cfg=balance, groups=groups)
        steps, applied = [], []
        for _ in range(STEPS):
            micro_batches = pipeline.next_step()
            samples = []
            for mb in micro_batches:
                assert sum(mb["sample_lengths"]) <= data_overrides.get("seq_len", SEQ_LEN)
                samples += _per_sample(mb, model.tokens, model.projector.spatial_merge_size)
            steps.append(samples)
            applied.append(bool(pipeline.last_balance.applied) if balance else False)
        pipeline.close()
        results[name] = {"steps": steps, "applied": applied, "state": pipeline.state_dict(),
                         "micro_batches": len(micro_batches), "rejects": pipeline.reject_counts()}
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path, world: int, layout=(1, 1), source="synthetic", paths=(), **data_overrides):
    run_workers(_worker, world, (world, free_port(), layout, source, list(paths), str(tmp_path), data_overrides),
                timeout_s=240)
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def _check_same_samples(results, leaders):
    """Per step: the balanced batches of all DP ranks together hold exactly the plain ones, sample
    by sample with their pixels (as multisets: a small set may hold one sample twice in a step)."""
    applied = 0
    for step in range(STEPS):
        balanced = Counter(s for rank in leaders for s in results[rank]["balanced"]["steps"][step])
        plain = Counter(s for rank in leaders for s in results[rank]["plain"]["steps"][step])
        assert balanced == plain
        applied += results[leaders[0]]["balanced"]["applied"][step]
    assert applied > 0, "no step was re-planned: the test checked nothing moving"


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_preserves_the_steps_samples_and_their_images(tmp_path, world):
    results = _run(tmp_path, world)
    _check_same_samples(results, leaders=list(range(world)))
    assert all(r["balanced"]["micro_batches"] == 2 for r in results)  # equal counts per rank
    # Every rank made the same decisions, and its checkpointable position is its own shard's.
    assert len({tuple(r["balanced"]["applied"]) for r in results}) == 1
    assert len({r["balanced"]["state"]["stream"]["cursor"] for r in results}) == world


def test_exchange_of_text_only_files_with_a_reject(tmp_path):
    # Text-only conversations of long-tailed lengths plus one malformed line: the reject is read by
    # one rank only, and every rank counts it.
    lines = []
    for i in range(120):
        words = " ".join(f"w{j}" for j in range(3 + (i * 37) % 90))
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"question {i}?"},
                                              {"role": "assistant", "content": words}]}))
    lines.insert(7, "{not json")
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(lines) + "\n")
    results = _run(tmp_path, 2, source="files", paths=[str(text)])
    _check_same_samples(results, leaders=[0, 1])
    assert all(r["balanced"]["rejects"] == {"malformed_json": 1} for r in results)


def test_exchange_with_tensor_parallel_replicas(tmp_path):
    # TP=2 x DP=2: the leaders exchange, each TP peer receives exactly its leader's batch.
    results = _run(tmp_path, 4, layout=(2, 1))
    _check_same_samples(results, leaders=[0, 2])
    for leader, peer in ((0, 1), (2, 3)):
        assert results[peer]["balanced"]["steps"] == results[leader]["balanced"]["steps"]
        assert results[peer]["balanced"]["state"] == {**results[leader]["balanced"]["state"],
                                                      "rejects": results[peer]["balanced"]["state"]["rejects"]}


def test_exchange_with_pipeline_stages(tmp_path):
    # PP=2 x DP=2: every stage of a DP rank sees the same reordered batch.
    results = _run(tmp_path, 4, layout=(1, 2))
    _check_same_samples(results, leaders=[0, 2])
    for leader, stage in ((0, 1), (2, 3)):
        assert results[stage]["balanced"]["steps"] == results[leader]["balanced"]["steps"]


def _transport_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from loongforge.parallel.data_groups import exchange_objects

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    silent = world - 1  # sends nothing to anyone, and nobody sends to it
    sends = [None if rank == silent or dst == silent else {"from": rank, "to": dst, "x": torch.arange(rank + 1)}
             for dst in range(world)]
    received = exchange_objects(sends, group)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        [None if r is None else [r["from"], r["to"], r["x"].tolist()] for r in received]))
    dist.destroy_process_group()


def test_transport_with_a_rank_that_sends_nothing(tmp_path):
    world = 4
    run_workers(_transport_worker, world, (world, free_port(), str(tmp_path)), timeout_s=120)
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = [None if rank == world - 1 or src == world - 1 else [src, rank, list(range(src + 1))]
                    for src in range(world)]
        assert got == expected


def test_sharded_reading_splits_the_stream_without_overlap(tokenizer):
    from loongforge.config.schema import DataConfig, ModelConfig
    from loongforge.data.pipeline import DataPipeline

    cfg = DataConfig(source="synthetic", synthetic_num_samples=300, seq_len=SEQ_LEN, seed=5, max_pixels=12544,
                     read="sharded", num_workers=0, shuffle=False)
    seen = Counter()
    for rank in range(3):
        pipeline = DataPipeline(cfg, ModelConfig(family="qwen2_5_vl"), global_batch_size=3, dp_rank=rank, dp_size=3,
                                pad_to_multiple=8, tokenizer=tokenizer, groups=None)
        ids = []
        while len(ids) < 10:
            ids += [sid for mb in pipeline.next_step() for sid in mb["sample_ids"]]
        seen.update(sid for sid in ids[:8])
        assert all(int(sid.split(":")[1]) % 3 == rank for sid in ids[:8])  # positions rank, rank+3, ...
    assert max(seen.values()) == 1


def test_exchange_moves_videos_and_multi_image_samples(tmp_path):
    # LLaMA-Factory's demo: two-image and one-image conversations plus videos, decoded from files.
    from tests.data.conftest import LLAMAFACTORY, require

    paths = [str(require(LLAMAFACTORY / name)) for name in ("mllm_video_demo.json", "mllm_demo.json")]
    # Rows of 512 tokens (1024 before): fewer samples decoded a step, two-image samples and videos among them.
    results = _run(tmp_path, 2, source="files", paths=paths, seq_len=512, video_max_frames=4,
                   video_max_pixels=128 * 28 * 28)
    _check_same_samples(results, leaders=[0, 1])
    trained = [s for r in results for step in r["balanced"]["steps"] for s in step]
    assert any(len(images) == 2 for _, _, images, _ in trained)  # a two-image sample
    assert any(videos for _, _, _, videos in trained)  # a video sample
    assert all(r["balanced"]["rejects"] == {} for r in results)
