"""DataPipeline: the micro-batch contract, DP invariance, exact resume, and accounting of samples."""

import dataclasses
import json
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import SampleMeasurer
from loongforge.data.pipeline import DataPipeline, RejectLog, RowStream
from loongforge.data.samples import Reject
from loongforge.models.media import SECONDS_PER_GRID_T, MediaBatch
from loongforge.models.qwen2_5_vl.rope_index import get_rope_index
from tests.data.conftest import EXPECTED_REASONS, LLAMAFACTORY, LOONGFORGE_VLM, require
from tests.models.helpers import free_port, limit_threads, run_workers

MODEL = ModelConfig(family="qwen2_5_vl")


def _pipeline(tokenizer, data_cfg, *, gbs=4, dp_rank=0, dp_size=1, pad=16, rejects_path=None, **kwargs):
    return DataPipeline(data_cfg, MODEL, global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size,
                        pad_to_multiple=pad, rejects_path=rejects_path, tokenizer=tokenizer, **kwargs)


def _synthetic(**overrides):
    return DataConfig(**{"source": "synthetic", "synthetic_num_samples": 60, "seq_len": 512, "num_workers": 0,
                         "seed": 5, **overrides})


def _assert_same_batches(left: list[dict], right: list[dict]):
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            elif isinstance(a[key], MediaBatch):
                _assert_same_media(a[key], b[key])
            else:
                assert a[key] == b[key], key


def _assert_same_media(left: MediaBatch, right: MediaBatch):
    for a, b in ((left.images, right.images), (left.videos, right.videos)):
        assert (a is None) == (b is None)
        if a is None:
            continue
        for field in ("grids", "rows", "features", "sizes"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), field
        assert a.facts.keys() == b.facts.keys() and all(torch.equal(a.facts[k], b.facts[k]) for k in a.facts)
        assert a.samples == b.samples


def test_micro_batch_contract(tokenizer):
    pipeline = _pipeline(tokenizer, _synthetic(), pad=16)
    micro_batches = pipeline.next_step()
    assert len(micro_batches) == 4
    for mb in micro_batches:
        T = mb["input_ids"].shape[1]
        real = sum(mb["sample_lengths"])
        assert T % 16 == 0 and real <= 512 and T - real < 16
        assert mb["input_ids"].shape == mb["labels"].shape == mb["loss_mask"].shape == (1, T)
        assert mb["input_ids"].dtype == mb["labels"].dtype == torch.long and mb["loss_mask"].dtype == torch.float32
        assert mb["position_ids"].shape == (3, 1, T) and mb["position_ids"].dtype == torch.long
        cu = mb["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T
        assert (cu[1:] - cu[:-1]).tolist() == mb["sample_lengths"] + ([T - real] if T > real else [])
        assert len(mb["sample_ids"]) == len(mb["sample_lengths"])
        assert mb["num_loss_tokens"] == int(mb["loss_mask"].sum()) > 0
        ids, labels, mask = mb["input_ids"][0], mb["labels"][0], mb["loss_mask"][0]
        num_samples = len(mb["sample_lengths"])
        for start, end in zip(cu[:num_samples].tolist(), cu[1:num_samples + 1].tolist()):
            assert torch.equal(labels[start:end - 1], ids[start + 1:end])  # shifted within the sample
            assert labels[end - 1] == 0 and mask[end - 1] == 0  # no target across samples
            assert mb["position_ids"][:, 0, start].tolist() == [0, 0, 0]  # restarts per sample
        assert (ids[real:] == MODEL.tokens.pad_token_id).all() and (mask[real:] == 0).all()
        assert (labels[real:] == 0).all()
        # targets under the mask are answer tokens: never vision tokens, never the role header
        assert not torch.isin(labels[mask.bool()], torch.tensor([151652, 151653, 151655, 151644])).any()
        grids = mb["media"].images.grids
        assert mb["media"].images.rows.shape == (int(grids.prod(-1).sum()), 1176)
        assert int((ids == MODEL.tokens.image_token_id).sum()) == int(grids.prod(-1).sum()) // 4


def test_position_ids_are_rope_index_per_sample(tokenizer):
    mb = _pipeline(tokenizer, _synthetic()).next_step()[0]
    cu = mb["cu_seqlens"].tolist()
    grids = iter(mb["media"].images.grids)
    for start, end in zip(cu[:-1], cu[1:len(mb["sample_lengths"]) + 1]):
        ids = mb["input_ids"][0, start:end]
        n_images = int((ids == MODEL.tokens.vision_start_token_id).sum())
        sample_grids = torch.stack([next(grids) for _ in range(n_images)]) if n_images else None
        expected = get_rope_index(ids, sample_grids, None, None, spatial_merge_size=2, image_token_id=151655,
                                  video_token_id=151656, vision_start_token_id=151652, tokens_per_second=2)
        assert torch.equal(mb["position_ids"][:, 0, start:end], expected)


def test_dp_split_union_equals_single_rank(tokenizer):
    single = _pipeline(tokenizer, _synthetic(), gbs=4, dp_size=1)
    ranks = [_pipeline(tokenizer, _synthetic(), gbs=4, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        expected = single.next_step()
        per_rank = [p.next_step() for p in ranks]
        assert [len(mbs) for mbs in per_rank] == [2, 2]
        _assert_same_batches(per_rank[0] + per_rank[1], expected)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_from_state_dict_gives_identical_batches(tokenizer, num_workers):
    # 30 samples, ~15 per row, 4 rows per step: epochs turn over every other step, with reshuffles.
    cfg = _synthetic(synthetic_num_samples=30, num_workers=num_workers, shuffle=True)
    first = _pipeline(tokenizer, cfg)
    for _ in range(3):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    continued = [first.next_step() for _ in range(4)]
    assert state["stream"]["epoch"] >= 1  # the test really crossed an epoch boundary
    resumed = _pipeline(tokenizer, cfg)
    resumed.load_state_dict(state)
    for expected in continued:
        _assert_same_batches(resumed.next_step(), expected)
    first.close()
    resumed.close()


def test_close_rewinds_prefetched_steps(tokenizer):
    cfg = _synthetic(num_workers=2)
    reference = _pipeline(tokenizer, _synthetic())
    expected = [reference.next_step() for _ in range(4)]
    prefetching = _pipeline(tokenizer, cfg, prefetch_steps=3)
    _assert_same_batches(prefetching.next_step(), expected[0])
    prefetching.close()  # the worker had packed steps 2.. ahead; they must not be lost
    for step in expected[1:]:
        _assert_same_batches(prefetching.next_step(), step)
    prefetching.close()


def test_every_sample_in_one_row_or_rejected_once(tokenizer, bad_data, tmp_path):
    rejects_path = tmp_path / "rejects.jsonl"
    cfg = DataConfig(source="files", paths=[str(bad_data), str(require(LLAMAFACTORY / "mllm_demo.json"))],
                     seq_len=1024, num_workers=0, shuffle=True)
    pipeline = _pipeline(tokenizer, cfg, gbs=1, rejects_path=rejects_path)
    num_records = len(pipeline.stream.source)
    epoch0_positions = []
    # Run until epoch 0 has fully left the packing buffer; later epochs meet the rejects again.
    while pipeline.stream.epoch < 3 or any(key[0] == 0 for key in pipeline.stream.packer.buffer_keys()):
        row = pipeline.stream.next_row()
        assert sum(item.length for item in row) <= 1024
        epoch0_positions += [item.key[1] for item in row if item.key[0] == 0]
    pipeline.rejects.record_all(pipeline.stream.rejects.take())  # rows read as next_step consumes them
    lines = [json.loads(line) for line in rejects_path.read_text().splitlines()]
    assert sorted((r["line"], r["reason"]) for r in lines) == sorted(EXPECTED_REASONS.items())
    assert all(r["file"] == str(bad_data) and r["detail"] for r in lines)
    assert all(r["record"] == r["line"] - 1 for r in lines)  # one record a line: its ordinal is its line - 1
    assert sum(pipeline.reject_counts().values()) == len(EXPECTED_REASONS)
    assert len(epoch0_positions) == len(set(epoch0_positions))  # no sample twice in an epoch
    assert len(epoch0_positions) + len(EXPECTED_REASONS) == num_records == 16  # none silently dropped


def test_records_of_a_one_line_json_list_are_each_rejected_once(tokenizer, tmp_path):
    """A JSON list written on one line: its records all start on line 1, yet each bad one is its
    own reject, counted and written once however often epochs (or a resumed run) meet it."""
    bad_roles = {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}
    bad_roles_too = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}
    empty_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}
    good = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]}
    data = tmp_path / "one_line.json"
    data.write_text(json.dumps([bad_roles, good, bad_roles_too, empty_answer]))
    assert len(data.read_text().splitlines()) == 1
    rejects_path = tmp_path / "rejects.jsonl"
    cfg = DataConfig(source="files", paths=[str(data)], seq_len=256, num_workers=0, shuffle=True)
    pipeline = _pipeline(tokenizer, cfg, gbs=1, rejects_path=rejects_path)
    while pipeline.stream.epoch < 3:
        pipeline.next_step()
    expected = [{"file": str(data), "line": 1, "record": 0, "reason": "bad_roles"},
                {"file": str(data), "line": 1, "record": 2, "reason": "bad_roles"},
                {"file": str(data), "line": 1, "record": 3, "reason": "empty_answer"}]

    def written():
        lines = [json.loads(line) for line in rejects_path.read_text().splitlines()]
        assert all(r.pop("detail") for r in lines)
        return sorted(lines, key=lambda r: r.get("record", -1))

    assert pipeline.reject_counts() == {"bad_roles": 2, "empty_answer": 1}
    assert written() == expected
    # Resumed from its state, a run meets the same records again and counts none of them anew.
    resumed = _pipeline(tokenizer, cfg, gbs=1, rejects_path=rejects_path)
    resumed.load_state_dict(json.loads(json.dumps(pipeline.state_dict())))
    while resumed.stream.epoch < 6:
        resumed.next_step()
    assert written() == expected
    assert resumed.reject_counts() == {"bad_roles": 2, "empty_answer": 1}


def test_rows_padded_to_seq_len_for_pipeline_parallel(tokenizer):
    for mb in _pipeline(tokenizer, _synthetic(), pad=512).next_step():
        assert mb["input_ids"].shape == (1, 512) and mb["cu_seqlens"][-1] == 512


def test_samples_padded_to_2cp_inside_their_segments_for_context_parallelism(tokenizer):
    """sample_multiple 4 (CP 2): each segment a multiple of 4; its padding trains nothing, is marked
    padding and continues the sample's positions; the packer counted the padded lengths."""
    plain = _pipeline(tokenizer, _synthetic(), gbs=2).next_step()
    padded = _pipeline(tokenizer, _synthetic(), gbs=2, pad=16, sample_multiple=4).next_step()
    for mb in padded:
        segments = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
        assert all(length % 4 == 0 for length in segments), segments
        assert sum(segments) <= 512 and mb["input_ids"].shape[1] == sum(segments)
        starts = mb["cu_seqlens"][:-1].tolist()
        for start, real in zip(starts, mb["sample_lengths"]):
            pad = -real % 4
            span = slice(start + real, start + real + pad)
            assert mb["padding_mask"][0, span].all() and not mb["padding_mask"][0, start:start + real].any()
            assert mb["loss_mask"][0, span].sum() == 0 and (mb["labels"][0, span] == 0).all()
            last = mb["position_ids"][:, 0, start + real - 1]  # [3]
            assert torch.equal(mb["position_ids"][:, 0, span], last[:, None] + torch.arange(1, pad + 1))
    # Same samples, same real tokens and answers: the padding adds none.
    assert padded[0]["sample_ids"][:2] == plain[0]["sample_ids"][:2]
    assert padded[0]["num_loss_tokens"] > 0


def test_real_demo_conversations_with_images_and_video(tokenizer):
    pytest.importorskip("av")
    paths = [LLAMAFACTORY / "mllm_demo.json", LLAMAFACTORY / "mllm_video_demo.json",
             LLAMAFACTORY / "v1_multimodal_demo.jsonl", LOONGFORGE_VLM / "mix.json", LOONGFORGE_VLM / "mllm_demo.json"]
    cfg = DataConfig(source="files", paths=[str(require(p)) for p in paths], seq_len=8192, num_workers=2,
                     shuffle=False, video_max_frames=16)
    pipeline = _pipeline(tokenizer, cfg, gbs=2)
    seen, videos, images = [], 0, 0
    while len(set(seen)) < 45:
        for mb in pipeline.next_step():
            seen += mb["sample_ids"]
            assert sum(mb["sample_lengths"]) <= 8192
            if mb["media"].videos is not None:
                grids = mb["media"].videos.grids
                videos += len(grids)
                assert mb["media"].videos.rows.shape == (int(grids.prod(-1).sum()), 1176)
                assert mb["media"].videos.facts[SECONDS_PER_GRID_T].shape == (len(grids),)
                assert int((mb["input_ids"] == 151656).sum()) == int(grids.prod(-1).sum()) // 4
                assert (grids[:, 0] <= 8).all()  # video_max_frames=16 -> at most 8 temporal patches
            if mb["media"].images is not None:
                images += len(mb["media"].images)
                assert np.isfinite(mb["media"].images.rows.numpy()).all()
        assert len(seen) < 100, "demo samples did not all arrive"
    pipeline.close()
    assert pipeline.reject_counts() == {}
    assert videos >= 2 and images >= 10
    assert any(s.startswith(str(LLAMAFACTORY / "mllm_video_demo.json")) for s in seen)


def _png(path, *, corrupt_past_its_header=False):
    """A 64 x 48 PNG; ``corrupt_past_its_header``: its header reads well, its pixels do not decode."""
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(png, format="PNG")
    data = bytearray(png.getvalue())
    if corrupt_past_its_header:
        idat = data.index(b"IDAT") + 4
        data[idat:idat + 8] = b"\x00garbage"  # header and IEND intact; pixel data broken
    path.write_bytes(bytes(data))
    return path


def test_media_corrupt_past_its_header_trains_nothing_and_is_reported(tokenizer, tmp_path):
    _png(tmp_path / "broken.png", corrupt_past_its_header=True)
    record = {"messages": [{"role": "user", "content": "<image>colour?"}, {"role": "assistant", "content": "Red."}],
              "images": ["broken.png"]}
    (tmp_path / "d.json").write_text(json.dumps([record]))
    rejects_path = tmp_path / "rejects.jsonl"
    cfg = DataConfig(source="files", paths=[str(tmp_path / "d.json")], seq_len=256, num_workers=0)
    mb = _pipeline(tokenizer, cfg, gbs=1, rejects_path=rejects_path).next_step()[0]
    images = mb["media"].images
    assert mb["num_loss_tokens"] == 0 and not images.rows.any()
    assert images.rows.shape == (int(images.grids.prod(-1).sum()), 1176)
    [reject] = [json.loads(line) for line in rejects_path.read_text().splitlines()]
    assert reject["reason"] == "corrupt_image" and reject["line"] == 1 and "decoding" in reject["detail"]


def _demo_stream(tokenizer, *, seq_len, shard=(0, 1), shuffle=True, rejects_path=None):
    """The real demo data (6 conversations) read as one shard of a data-parallel run."""
    cfg = DataConfig(source="files", paths=[str(require(LLAMAFACTORY / "mllm_demo.json"))],
                     seq_len=seq_len, num_workers=0, shuffle=shuffle, max_pixels=50176)  # qwen2.5vl-tiny's
    return RowStream(FileSamples(cfg.paths), SampleMeasurer(tokenizer, cfg, MODEL), seq_len=seq_len,
                     lookahead=4, shuffle=shuffle, seed=cfg.seed, rejects=RejectLog(rejects_path), shard=shard)


@pytest.mark.parametrize("shard_index", [0, 1])
def test_sharded_reader_survives_reject_runs_across_epochs(tokenizer, shard_index):
    # 4 of the 6 demo conversations are longer than 128 tokens; a shard sees 3 positions an epoch,
    # so runs of more than 6 rejects in a row happen although 2 samples are fine.
    stream = _demo_stream(tokenizer, seq_len=128, shard=(shard_index, 2))
    accepted = {item.payload.sample_id for _ in range(30) for item in stream.next_row()}
    assert len(accepted) == 2
    assert stream.rejects.counts() == {"too_long": 4}


def test_all_samples_rejected_is_one_input_error_with_counts(tokenizer, tmp_path):
    stream = _demo_stream(tokenizer, seq_len=16, shard=(1, 2), rejects_path=tmp_path / "rejects.jsonl")
    with pytest.raises(InputError) as error:
        stream.next_row()
    message = str(error.value)
    assert "\n" not in message
    assert message == f"all 6 samples were rejected (too_long: 6); see {tmp_path / 'rejects.jsonl'}"


def test_unshuffled_shard_with_only_bad_samples_names_its_share(tokenizer):
    stream = _demo_stream(tokenizer, seq_len=16, shard=(0, 2), shuffle=False)
    with pytest.raises(InputError, match=r"all 3 samples of this rank's share .* were rejected \(too_long: 3\)"):
        stream.next_row()


@pytest.mark.parametrize("change", [{"seed": 7}, {"shuffle": False}])
def test_a_position_resumed_in_another_order_is_refused(tokenizer, change):
    """A saved (epoch, cursor) indexes data.seed's / data.shuffle's permutation: resumed in another,
    the rest of the epoch is the new order's tail. Counted here on 120 samples: what such a resume
    would train twice and never; it now stops, naming the key, unless data.accept_new_order=true."""
    cfg = _synthetic(synthetic_num_samples=120, seed=3, shuffle=True)
    first = _pipeline(tokenizer, cfg)
    for _ in range(2):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    cursor = state["stream"]["cursor"]
    other_cfg = _synthetic(**{**dict(synthetic_num_samples=120, seed=3, shuffle=True), **change})
    other = _pipeline(tokenizer, other_cfg)
    before, after = first.stream.epoch_order(0)[:cursor], other.stream.epoch_order(0)[cursor:]
    twice, never = len(set(before) & set(after)), 120 - len(set(before) | set(after))
    print(f"{change}: resumed at sample {cursor} of 120, the old code would train {twice} samples twice "
          f"and {never} never in epoch 0")
    assert twice == never > 0
    key = f"data.{next(iter(change))}"
    with pytest.raises(InputError, match=rf"was trained with {key}=\S+ and this run has {key}="):
        other.load_state_dict(state)
    # Asked for: the data starts afresh in the new order (the rejects seen are kept).
    fresh = _pipeline(tokenizer, other_cfg)
    restarted = _pipeline(tokenizer, dataclasses.replace(other_cfg, accept_new_order=True))
    restarted.load_state_dict(state)
    assert restarted.resume_note.startswith("data.accept_new_order=true: the data order changed")
    _assert_same_batches(restarted.next_step(), fresh.next_step())
    for pipeline in (other, fresh, restarted):
        pipeline.close()
    # The same order resumes as before, with or without data.accept_new_order.
    same = _pipeline(tokenizer, dataclasses.replace(cfg, accept_new_order=True))
    same.load_state_dict(state)
    assert same.resume_note is None and same.state_dict()["stream"]["cursor"] == cursor
    same.close()


def _every_third_malformed(path, count=150):
    """``count`` short conversations, every third line malformed JSON: rejects all along the stream."""
    good = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]})
    path.write_text("".join(('{"messages": [\n' if line % 3 == 0 else good + "\n") for line in range(1, count + 1)))
    return path


@pytest.mark.parametrize("read", ["global", "sharded"])
def test_rejects_counted_are_those_of_the_consumed_steps_whatever_the_prefetch_and_layout(tokenizer, tmp_path, read):
    """Issue 49: the count was what the prefetching reader had reached (16,858 once, 20,011 the
    next time, 15,408-20,011 across layouts). It is now the rejects met making the steps consumed,
    rejects.jsonl holds exactly those, and a resume from the state continues the same count."""
    data = _every_third_malformed(tmp_path / "data.jsonl")
    cfg = DataConfig(source="files", paths=[str(data)], seq_len=64, shuffle=False, read=read,
                     cache_dir=str(tmp_path / "cache"))
    figures = {}
    for workers, dp_size in ((0, 1), (1, 1), (2, 2)):  # 2 workers: a thread pool decodes too
        if read == "sharded" and dp_size > 1:  # a lone shard counts only its own share (no exchange group)
            continue
        path = tmp_path / f"rejects-{workers}-{dp_size}.jsonl"
        pipeline = _pipeline(tokenizer, DataConfig(**{**cfg.__dict__, "num_workers": workers}), gbs=2,
                             dp_size=dp_size, rejects_path=path, lookahead=4, prefetch_steps=3)
        for step in range(1, 5):
            pipeline.next_step()
            if step == 2:
                at_step_2 = json.loads(json.dumps(pipeline.state_dict()))
        state = json.loads(json.dumps(pipeline.state_dict()))
        pipeline.close()  # lets the prefetched steps 5-7 finish: they must not count
        listed = {(r["line"], r["reason"]) for r in map(json.loads, path.read_text().splitlines())}
        figures[(workers, dp_size)] = (sum(pipeline.reject_counts().values()), len(listed),
                                       sum(state["rejects"]["counts"].values()))
    # Resumed at step 2 in the folder of the run that went on to step 4: the file is cut back to the
    # checkpoint's rejects, and the resumed run lists the later ones once, as the run did.
    resumed = _pipeline(tokenizer, DataConfig(**{**cfg.__dict__, "num_workers": 1}), gbs=2, rejects_path=path,
                        lookahead=4, prefetch_steps=3)
    resumed.load_state_dict(at_step_2)
    assert len(path.read_text().splitlines()) == sum(at_step_2["rejects"]["counts"].values()) < figures[(0, 1)][0]
    for _ in range(2):
        resumed.next_step()
    resumed.close()
    assert len(path.read_text().splitlines()) == sum(resumed.reject_counts().values()) == figures[(0, 1)][0]
    print(f"data.read={read}: rejects after 4 steps (counted, listed, checkpointed) by (num_workers, DP size): "
          f"{figures}")
    assert len(set(figures.values())) == 1 and len(set(figures[(0, 1)])) == 1 and figures[(0, 1)][0] > 0


def test_a_reject_of_a_checkpoint_saved_before_record_ordinals_is_not_counted_again(tmp_path):
    """Checkpoints saved before every record had its ordinal keyed a record alone on its line by
    (file, line, reason): the same reject met again, now with its ordinal, is the one already counted."""
    path = tmp_path / "rejects.jsonl"
    old = Reject(file="a.jsonl", line=3, reason="malformed_json", detail="x")
    path.write_text(json.dumps(old.to_json()) + "\n")
    log = RejectLog(path)
    log.load_state_dict({"seen": [["a.jsonl", 3, "malformed_json"]], "counts": {"malformed_json": 1}})
    log.record(Reject(file="a.jsonl", line=3, reason="malformed_json", detail="x", record=2))
    log.record(Reject(file="a.jsonl", line=4, reason="malformed_json", detail="y", record=3))
    print(f"after resuming an older checkpoint: counted {log.counts()}, listed {len(path.read_text().splitlines())}")
    assert log.counts() == {"malformed_json": 2} and len(path.read_text().splitlines()) == 2


def _every_third_corrupt_past_its_header(folder):
    """48 one-image conversations, every third image's pixels corrupt (a reject found only when the
    rank that trains it decodes it), and every eighth line malformed (found measuring, by every rank)."""
    _png(folder / "good.png")
    _png(folder / "broken.png", corrupt_past_its_header=True)
    lines = []
    for line in range(1, 49):
        image = "broken.png" if line % 3 == 0 else "good.png"
        record = {"messages": [{"role": "user", "content": f"<image>Colour {line}?"},
                               {"role": "assistant", "content": "Red. " * (1 + line % 4)}], "images": [image]}
        lines.append('{"messages": [' if line % 8 == 0 else json.dumps(record))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "data.jsonl"


def _decoding_rejects(tokenizer, data, rejects_path, *, dp_rank, dp_size, num_workers, dp_group=None):
    """(counted, checkpointed) rejects after 3 steps of 2 rows, read global."""
    cfg = DataConfig(source="files", paths=[str(data)], seq_len=256, shuffle=False, read="global",
                     num_workers=num_workers, max_pixels=50176)
    pipeline = _pipeline(tokenizer, cfg, gbs=2, dp_rank=dp_rank, dp_size=dp_size, rejects_path=rejects_path,
                         lookahead=4, dp_group=dp_group, samples=FileSamples(cfg.paths))  # no Arrow copy to make
    for _ in range(3):
        pipeline.next_step()
    pipeline.close()
    return pipeline.reject_counts(), pipeline.state_dict()["rejects"]["counts"]


def _decoding_rejects_rank(rank, data, out, port):
    """DP rank ``rank`` of 2 over gloo, prefetching; rank 0 writes rejects.jsonl, as in training."""
    from loongforge.config.schema import ModelConfig
    from loongforge.data.tokenizer import load_tokenizer
    from loongforge.models.registry import get_family

    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        tokenizer = load_tokenizer("qwen", get_family("qwen2_5_vl").chat(ModelConfig(family="qwen2_5_vl")).jinja_template)
        figures = _decoding_rejects(tokenizer, data, out / "rejects.jsonl" if rank == 0 else None, dp_rank=rank,
                                    dp_size=2, num_workers=1, dp_group=dist.group.WORLD)
        (out / f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def test_rejects_found_decoding_are_every_ranks_at_dp_2_reading_global(tokenizer, tmp_path):
    """Issue 49: under data.read=global each DP rank decodes only the rows it trains, and a sample
    whose pixels are corrupt past a good header was counted only by that rank: rank 0's summary and
    rejects.jsonl held its own (6 of the 12 corrupt_image at DP 2 here, 12 at DP 1). Each step's
    rejects found decoding are now gathered over the data-parallel group when it is consumed."""
    data = _every_third_corrupt_past_its_header(tmp_path)
    one = tmp_path / "dp1"
    one.mkdir()
    figures = {"DP 1": _decoding_rejects(tokenizer, data, one / "rejects.jsonl", dp_rank=0, dp_size=1, num_workers=0)}
    two = tmp_path / "dp2"
    two.mkdir()
    run_workers(_decoding_rejects_rank, 2, (data, two, free_port()), timeout_s=120)
    for rank in range(2):
        figures[f"DP 2 rank {rank}"] = tuple(json.loads((two / f"rank{rank}.json").read_text()))
    print(f"rejects after 3 steps read global (counted, checkpointed): {figures}")
    assert figures["DP 1"][0]["corrupt_image"] > 0 and figures["DP 1"][0]["malformed_json"] > 0
    assert all(figure == figures["DP 1"] for figure in figures.values())
    assert (two / "rejects.jsonl").read_text() == (one / "rejects.jsonl").read_text()
