"""data.streaming=true: every record once per epoch, windows shuffled, shards disjoint, and a
resumed run continues with exactly the samples an uninterrupted run trains on."""

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.pipeline import DataPipeline
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.streaming import StreamingSamples
from tests.data.test_pipeline import _assert_same_batches


def _chat(i: int, words: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i} " + "word " * words},
                         {"role": "assistant", "content": f"answer {i}"}]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Three sources of 150 records in all, some bad: JSON lines, a JSON list, parquet."""
    folder = tmp_path_factory.mktemp("streaming")
    lines = [json.dumps(_chat(i, i % 37)) for i in range(100)]
    lines[7], lines[58] = '{"messages": [', json.dumps({"messages": [{"role": "user", "content": "q"}]})
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "b.json").write_text(json.dumps([_chat(100 + i, i) for i in range(30)], indent=1))
    pq.write_table(pa.Table.from_pylist([_chat(130 + i, 2 * i) for i in range(20)]), folder / "c.parquet")
    return [str(folder / name) for name in ("a.jsonl", "b.json", "c.parquet")]


def _cfg(inputs, **overrides):
    return DataConfig(**{"source": "files", "paths": inputs, "streaming": True, "shuffle_window": 16,
                         "seq_len": 256, "num_workers": 0, "seed": 3, **overrides})


def _pipeline(tokenizer, cfg, *, dp_rank=0, dp_size=1, gbs=4):
    return DataPipeline(cfg, ModelConfig(family="qwen2_5_vl"), global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size,
                        pad_to_multiple=8, tokenizer=tokenizer, lookahead=8)


def test_each_window_is_a_permutation_of_the_records_mixed(inputs, tmp_path):
    every = ArrowSamples(inputs, str(tmp_path / "cache"))
    expected = [every.get(i) for i in range(len(every))]
    plain = StreamingSamples(inputs, window=16, shuffle=False, seed=3)
    shuffled = StreamingSamples(inputs, window=16, shuffle=True, seed=3)
    mixed = [plain.get(0, p) for p in range(len(expected))]
    assert plain.get(0, len(expected)) is None
    assert sorted(map(repr, mixed)) == sorted(map(repr, expected))  # every record once
    for source in inputs:  # each entry read front to back, the entries mixed
        assert [r for r in mixed if r.file == source] == [r for r in expected if r.file == source]
    assert {r.file for r in mixed[:16]} == set(inputs)
    got = [shuffled.get(1, p) for p in range(len(expected))]
    assert got != mixed and shuffled.get(1, len(expected)) is None
    for start in range(0, len(expected), 16):
        window = got[start:start + 16]
        assert sorted(map(repr, window)) == sorted(map(repr, mixed[start:start + 16]))
    assert shuffled.get(2, 5) != shuffled.get(1, 5) or shuffled.get(2, 6) != shuffled.get(1, 6)  # per epoch


def test_every_stretch_of_the_stream_mixes_the_entries_in_proportion(tmp_path):
    # Issue 30: data.paths=[coco, math] streamed all of COCO, then all of math. Records of one
    # size, COCO 3x math's bytes: every window of 8 takes 6 COCO records and 2 math ones, until
    # both end together; the order is a function of the data alone, found again from any window.
    for name, count in (("coco", 90), ("math", 30)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(_chat(i, 5)) + "\n" for i in range(count)))
    paths = [str(tmp_path / "coco.jsonl"), str(tmp_path / "math.jsonl")]
    stream = StreamingSamples(paths, window=8, shuffle=True, seed=3)
    files = [stream.get(0, p).file for p in range(120)]
    per_window = [files[w:w + 8].count(paths[1]) for w in range(0, 120, 8)]
    print(f"\nmath records per window of 8: {per_window}")
    assert per_window == [2] * 15 and stream.get(0, 120) is None
    again = StreamingSamples(paths, window=8, shuffle=True, seed=3)
    again.load_starts(stream.state_for([77]))  # seeks to window 9 (records 72..79) directly
    assert [again.get(0, p) for p in range(77, 120)] == [stream.get(0, p) for p in range(77, 120)]
    assert [again.get(1, p) for p in range(0, 120, 7)] == [stream.get(1, p) for p in range(0, 120, 7)]


def test_a_position_saved_reading_entries_in_turn_is_refused_when_they_would_mix(inputs):
    stream = StreamingSamples(inputs, window=16, shuffle=False, seed=3)
    with pytest.raises(InputError, match="one after another"):
        stream.load_starts({"1": [0, 812, 17]})  # before issue 30: (source, offset, line)
    single = StreamingSamples(inputs[:1], window=16, shuffle=False, seed=3)
    single.load_starts({"0": [0, 0, 1]})  # one entry: the same stream either way
    assert single.get(0, 0) == StreamingSamples(inputs[:1], window=16, shuffle=False, seed=3).get(0, 0)


def test_shards_read_disjoint_halves_and_every_record_once(tokenizer, inputs, tmp_path):
    cfg = _cfg(inputs, read="sharded")
    every = ArrowSamples(inputs, str(tmp_path / "cache"))
    accepted = {s.sample_id for s in (every.get(i) for i in range(len(every))) if isinstance(s, ConversationSample)}
    assert len(accepted) == 148
    shards = [_pipeline(tokenizer, cfg, dp_rank=r, dp_size=2) for r in range(2)]
    seen = []
    for shard in shards:  # each shard's first epoch, as its stream delivers it to the packer
        ids = []
        while (item := shard.stream._pull()).key[0] == 0:
            ids.append(item.payload.sample_id)
        shard.rejects.record_all(shard.stream.rejects.take())  # the rows read, as if consumed
        rejected = sum(shard.reject_counts().values())
        assert len(ids) == len(set(ids)) == 75 - rejected  # 150 positions, every other one
        seen.append(set(ids))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == accepted
    assert {r.reason for r in [every.get(i) for i in (7, 58)]} == {"malformed_json", "bad_roles"}
    assert sum((Counter(shard.reject_counts()) for shard in shards), Counter()) == {"malformed_json": 1, "bad_roles": 1}


@pytest.mark.parametrize("read", ["global", "sharded"])
def test_resume_gives_the_samples_of_an_uninterrupted_run(tokenizer, inputs, read):
    cfg = _cfg(inputs, read=read, shuffle=True)
    dp = (1, 2) if read == "sharded" else (0, 1)
    first = _pipeline(tokenizer, cfg, dp_rank=dp[0], dp_size=dp[1])
    for _ in range(5):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    continued = [first.next_step() for _ in range(8)]
    assert first.stream.epoch >= 1 and state["stream"]["cursor"] > 16  # crossed windows and an epoch
    resumed = _pipeline(tokenizer, cfg, dp_rank=dp[0], dp_size=dp[1])
    resumed.load_state_dict(state)
    for expected in continued:
        _assert_same_batches(resumed.next_step(), expected)


def test_checkpoints_do_not_cross_between_streaming_and_indexed_reading(tokenizer, inputs):
    streaming = _pipeline(tokenizer, _cfg(inputs))
    streaming.next_step()
    indexed = _pipeline(tokenizer, _cfg(inputs, streaming=False))
    with pytest.raises(ValueError, match="streaming run; resume with data.streaming=true"):
        indexed.load_state_dict(streaming.state_dict())
    indexed.next_step()
    with pytest.raises(ValueError, match="not saved by a streaming run"):
        _pipeline(tokenizer, _cfg(inputs)).load_state_dict(indexed.state_dict())


def test_a_pass_without_one_usable_sample_is_one_input_error(tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [\n' + json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(InputError, match=r"whole pass over data.paths gave no usable sample "
                                         r"\(bad_roles: 1, malformed_json: 1\)"):
        _pipeline(tokenizer, _cfg([str(bad)])).next_step()
    assert isinstance(StreamingSamples([str(bad)], window=4, shuffle=False, seed=0).get(0, 0), Reject)
