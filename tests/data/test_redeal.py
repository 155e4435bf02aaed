"""loongforge.data.redeal: a sharded read's saved position dealt again to another DP size trains every
sample of every epoch exactly once across the restart (issue 30). In-process, on real RowStreams
over a stand-in source (random lengths, some rejects), and on DataPipelines over synthetic data."""

import json

import numpy as np
import pytest

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.measure import MeasuredSample
from loongforge.data.pipeline import DataPipeline, RejectLog, RowStream
from loongforge.data.redeal import merged_rejects, redeal, untrained_positions
from loongforge.data.samples import Reject
from tests.data.conftest import write_conversations

REJECTED = 7  # every 7th sample index is rejected by the stand-in source


class _Source:
    """``size`` samples of 5..40 tokens; indices divisible by REJECTED are rejects."""

    def __init__(self, size: int):
        self.lengths = np.random.default_rng(size).integers(5, 41, size)

    def __len__(self):
        return len(self.lengths)

    def get(self, index: int):
        if index % REJECTED == 0:
            return Reject(file="stand-in", line=index, reason="too_long", detail="")
        return MeasuredSample(sample_id=f"s:{index}", file="stand-in", line=index,
                              input_ids=np.zeros(self.lengths[index], np.int64),
                              is_answer=np.ones(self.lengths[index], bool))


class _Measured:
    def measure(self, sample):
        return sample


def _stream(source, shard, rejects=None) -> RowStream:
    return RowStream(source, _Measured(), seq_len=64, lookahead=6, shuffle=True, seed=3,
                     rejects=rejects or RejectLog(None), shard=shard)


def _train(streams, rows, trained):
    """Each stream packs ``rows[i]`` rows; what they hold is recorded as trained (epoch, position)."""
    for stream, count in zip(streams, rows):
        for _ in range(count):
            trained.extend(item.key for item in stream.next_row())


def _resize(streams, count, source):
    states = [json.loads(json.dumps(s.state_dict())) for s in streams]  # as a checkpoint keeps them
    resized = [_stream(source, (k, count)) for k in range(count)]
    for stream in resized:
        stream.load_state_dict(stream.redealt(states))
    return resized


def _assert_each_epoch_once(trained, source, epochs):
    accepted = [i for i in range(len(source)) if i % REJECTED]
    orders = _stream(source, (0, 1))
    for epoch in range(epochs):
        order = orders.epoch_order(epoch)
        ids = sorted(int(order[p]) for e, p in trained if e == epoch)
        assert ids == accepted, f"epoch {epoch}: {len(ids)} trained, {len(set(ids))} distinct of {len(accepted)}"


def test_worked_example_of_the_docstring():
    states = [{"epoch": 0, "cursor": 4, "buffer": [[0, 2]], "shard": [0, 2]},
              {"epoch": 0, "cursor": 9, "buffer": [], "shard": [1, 2]}]
    assert untrained_positions(states, 10) == {0: [2, 4, 6, 8, 9]}
    assert [s["dealt"] for s in redeal(states, 3, 10)] == [[[0, [2, 8]]], [[0, [4, 9]]], [[0, [6]]]]
    assert [(s["epoch"], s["cursor"]) for s in redeal(states, 3, 10)] == [(1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (2, 3), (3, 1)])
def test_resized_streams_train_every_sample_of_each_epoch_once(old, new):
    # Shards pack different numbers of rows, so at the save they stand in different epochs
    # (47 samples, about 2 an old row per shard): the re-deal must cover two unfinished epochs.
    source = _Source(47)
    streams = [_stream(source, (i, old)) for i in range(old)]
    trained = []
    _train(streams, [8 + 3 * i for i in range(old)], trained)
    epochs_at_save = sorted({s.epoch for s in streams})
    resized = _resize(streams, new, source)
    # Until the epoch after the latest one begun at the save is done too (regular sharding again).
    done = epochs_at_save[-1] + 2
    while any(s.dealt or s.epoch < done or any(e < done for e, _ in s.packer.buffer_keys()) for s in resized):
        _train(resized, [1] * new, trained)
    print(f"\n{old} -> {new}: old shards at epochs {epochs_at_save}, {len(trained)} trained")
    _assert_each_epoch_once(trained, source, epochs=done)


def test_twice_resized_before_the_dealt_positions_are_read():
    # 2 -> 4 -> 3: the second save holds positions dealt by the first re-deal, not yet read.
    source = _Source(47)
    trained = []
    streams = [_stream(source, (i, 2)) for i in range(2)]
    _train(streams, [5, 7], trained)
    streams = _resize(streams, 4, source)
    _train(streams, [1, 2, 1, 1], trained)
    assert any(s.dealt for s in streams)
    streams = _resize(streams, 3, source)
    while any(s.dealt or s.epoch < 3 or any(e < 3 for e, _ in s.packer.buffer_keys()) for s in streams):
        _train(streams, [1] * 3, trained)
    _assert_each_epoch_once(trained, source, epochs=3)


def test_positions_claimed_by_two_shards_are_refused():
    states = [{"epoch": 0, "cursor": 0, "buffer": [[0, 1]], "shard": [0, 2]},
              {"epoch": 0, "cursor": 1, "buffer": [], "shard": [1, 2]}]
    with pytest.raises(ValueError, match=r"epoch 0 positions \[1\]"):
        redeal(states, 3, 4)
    with pytest.raises(ValueError, match="not one each"):
        redeal(states[:1], 3, 4)


def test_merged_rejects_count_each_reject_once():
    first, second = RejectLog(None), RejectLog(None)
    for log, lines in ((first, [1, 2]), (second, [2, 3])):
        for line in lines:
            log.record(Reject(file="f", line=line, reason="too_long", detail=""))
    merged = RejectLog(None)
    merged.load_state_dict(merged_rejects([first.state_dict(), second.state_dict()]))
    assert merged.counts() == {"too_long": 3}


# ------------------------------------------------------------ DataPipeline.load_state_dict

MODEL = ModelConfig(family="qwen2_5_vl")


def _sharded(tokenizer, dp_rank, dp_size, **overrides):
    cfg = DataConfig(**{"source": "synthetic", "synthetic_num_samples": 40, "seq_len": 512, "num_workers": 0,
                        "seed": 5, "read": "sharded", **overrides})
    return DataPipeline(cfg, MODEL, global_batch_size=4, dp_rank=dp_rank, dp_size=dp_size, pad_to_multiple=16,
                        tokenizer=tokenizer)


def _streamed(path):
    return {"source": "files", "paths": [str(path)], "streaming": True, "shuffle_window": 8}


def _recorded(pipeline, trained):
    """Record the (epoch, position) of every sample the pipeline's rows hold (num_workers=0: every
    row made is a row trained)."""
    next_row = pipeline.stream.next_row

    def recording():
        row = next_row()
        trained.extend(item.key for item in row)
        return row

    pipeline.stream.next_row = recording
    return pipeline


@pytest.mark.parametrize("streaming", [False, True], ids=["indexed", "streaming"])
@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (2, 1)])
def test_pipelines_resumed_at_another_dp_size_train_the_epoch_once(tokenizer, tmp_path, old, new, streaming):
    # 40 samples (synthetic images and text, or streamed text conversations in windows of 8): the
    # old ranks train 2 steps, the new ones until the first epoch is done everywhere (dealt
    # positions read, none left buffered).
    data = _streamed(write_conversations(tmp_path / "chats.jsonl", 40)) if streaming else {}
    trained = []
    before = [_recorded(_sharded(tokenizer, r, old, **data), trained) for r in range(old)]
    for _ in range(2):
        for pipeline in before:
            pipeline.next_step()
    saved = [json.loads(json.dumps(p.state_dict())) for p in before]
    after = [_recorded(_sharded(tokenizer, r, new, **data), trained) for r in range(new)]
    for rank, pipeline in enumerate(after):
        pipeline.load_state_dict(saved[rank % old], saved_states=lambda: saved)
    assert all(p.stream.dealt for p in after)
    while any(p.stream.dealt or any(e == 0 for e, _ in p.stream.packer.buffer_keys()) for p in after):
        for pipeline in after:
            pipeline.next_step()
    first_epoch = sorted(p for e, p in trained if e == 0)
    print(f"\n{'streamed' if streaming else 'indexed'} DP {old} -> {new}: {len(first_epoch)} samples of epoch 0 "
          f"trained, {len(set(first_epoch))} distinct")
    assert first_epoch == list(range(40))


def _recorded_when_made(pipeline, made: list) -> DataPipeline:
    """Append, per step the pipeline makes (in its loader thread when it prefetches), the (epoch,
    sample id) of its rows' samples: the first N entries are the N steps handed out, the rest were
    made ahead and dropped (a save keeps the position after the last step handed out)."""
    produce, next_row = pipeline._produce_step, pipeline.stream.next_row

    def recording_next_row():
        row = next_row()
        made[-1].extend((item.key[0], item.payload.sample_id) for item in row)
        return row

    def producing():
        made.append([])
        return produce()

    pipeline.stream.next_row, pipeline._produce_step = recording_next_row, producing
    return pipeline


STREAMED_REJECTED = (10, 55, 99)  # malformed lines among the 120 conversations


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2)])
def test_streamed_resize_as_run_trains_the_epoch_once(tokenizer, tmp_path, old, new):
    # The worry "streamed epochs may double count a few buffered records after a DP resize", as a
    # user runs it: a loader thread making steps ahead (num_workers=1; the steps made past the save
    # are dropped), the packer holding up to 32 positions (DataPipeline's lookahead), the save
    # mid-epoch inside a shuffle window of 16 (at DP 4 the shards stand in epoch 1, epoch 0 records
    # still buffered), rejects among the records. Conversations only: measuring a text document
    # (split_special_tokens=True) leaves that switch set on the tokenizer, so the loader threads of
    # pipelines sharing one tokenizer in one process would race over documents (a rank has its own).
    path = write_conversations(tmp_path / "chats.jsonl", 120)
    lines = path.read_text().splitlines()
    for line in STREAMED_REJECTED:
        lines[line] = '{"messages": ['
    path.write_text("\n".join(lines) + "\n")
    data = {**_streamed(path), "shuffle_window": 16, "num_workers": 1, "seq_len": 256}
    made_before, made_after = [[] for _ in range(old)], [[] for _ in range(new)]
    before = [_recorded_when_made(_sharded(tokenizer, r, old, **data), made_before[r]) for r in range(old)]
    for _ in range(2):
        for pipeline in before:
            pipeline.next_step()
    saved = [json.loads(json.dumps(p.state_dict())) for p in before]
    for pipeline in before:
        pipeline.close()  # the loader thread's steps made ahead are dropped
    positions = [(s["stream"]["epoch"], s["stream"]["cursor"], len(s["stream"]["buffer"])) for s in saved]
    assert all(len(made) > 2 for made in made_before), "the loader thread made no step ahead"
    assert all(buffered for _, _, buffered in positions) and any(cursor % 16 for _, cursor, _ in positions)
    last = max(epoch for epoch, _, _ in positions)  # each shard's epoch, up to this one, to finish
    after = [_recorded_when_made(_sharded(tokenizer, r, new, **data), made_after[r]) for r in range(new)]
    for rank, pipeline in enumerate(after):
        pipeline.load_state_dict(saved[rank % old], saved_states=lambda: saved)
    steps = 0
    while any(s["dealt"] or s["epoch"] <= last or any(e <= last for e, *_ in s["buffer"])
              for s in (p.state_dict()["stream"] for p in after)):
        for pipeline in after:
            pipeline.next_step()
        steps += 1
    rejects = [p.state_dict()["rejects"] for p in after]
    for pipeline in after:
        pipeline.close()
    trained = [key for made in made_before for step in made[:2] for key in step]
    trained += [key for made in made_after for step in made[:steps] for key in step]
    epochs = [sorted(sid for e, sid in trained if e == epoch) for epoch in range(last + 1)]
    expected = sorted(f"{path}[{i}]" for i in range(120) if i not in STREAMED_REJECTED)
    union = merged_rejects(rejects)["counts"]
    print(f"\nstreamed DP {old} -> {new}, loader thread, window 16: saved (epoch, cursor, buffered) {positions}, "
          f"{sum(len(m) - 2 for m in made_before)} steps made ahead dropped; " + "; ".join(
              f"epoch {e}: {len(ids)} trained, {len(set(ids))} distinct, {len(expected)} expected"
              for e, ids in enumerate(epochs)) + f"; rejects {union} (3 expected)")
    assert epochs == [expected] * (last + 1)
    assert union == {"malformed_json": len(STREAMED_REJECTED)}
    assert all(sum(r["counts"].values()) <= len(STREAMED_REJECTED) for r in rejects)


def test_a_position_saved_without_shards_resumes_only_at_its_dp_size(tokenizer):
    old = _sharded(tokenizer, 1, 2)
    old.next_step()
    state = old.state_dict()
    del state["stream"]["shard"], state["stream"]["dealt"]  # as an older loongforge saved it
    _sharded(tokenizer, 1, 2).load_state_dict(state, saved_dp_size=2)
    with pytest.raises(InputError) as error:
        _sharded(tokenizer, 1, 4).load_state_dict(state, saved_dp_size=2, checkpoint="ckpt/step_00000002")
    message = str(error.value)
    assert "\n" not in message and message.startswith("ckpt/step_00000002 holds")
    assert "data-parallel size 2" in message and "this run has 4" in message
    assert message.endswith("resume at data-parallel size 2")


def test_same_dp_size_with_ranks_mapped_differently_takes_its_own_shard(tokenizer):
    # A TP x PP change can hand DP rank 1 the rank file DP rank 0 wrote.
    saved = []
    for rank in range(2):
        pipeline = _sharded(tokenizer, rank, 2)
        pipeline.next_step()
        saved.append(pipeline.state_dict())
    resumed = _sharded(tokenizer, 1, 2)
    resumed.load_state_dict(saved[0], saved_states=lambda: saved)
    assert resumed.state_dict()["stream"] == saved[1]["stream"]


def test_a_sharded_position_resumed_by_global_reading_names_the_fix(tokenizer):
    # data.read=auto reads sharded at DP 2 and globally at DP 1.
    old = _sharded(tokenizer, 0, 2)
    old.next_step()
    with pytest.raises(InputError) as error:
        _sharded(tokenizer, 0, 1, read="global").load_state_dict(old.state_dict(), checkpoint="ckpt/step_00000002")
    assert str(error.value).startswith("ckpt/step_00000002 holds the data position of data.read=sharded")
    assert "set data.read=sharded to resume" in str(error.value)
