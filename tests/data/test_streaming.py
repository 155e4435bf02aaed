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
    return DataPipeline(cfg, ModelConfig(), global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size,
                        pad_to_multiple=8, tokenizer=tokenizer, lookahead=8)


def test_each_window_is_a_permutation_of_the_records_in_order(inputs, tmp_path):
    every = ArrowSamples(inputs, str(tmp_path / "cache"))
    expected = [every.get(i) for i in range(len(every))]
    plain = StreamingSamples(inputs, window=16, shuffle=False, seed=3)
    shuffled = StreamingSamples(inputs, window=16, shuffle=True, seed=3)
    assert [plain.get(0, p) for p in range(len(expected))] == expected and plain.get(0, len(expected)) is None
    got = [shuffled.get(1, p) for p in range(len(expected))]
    assert got != expected and shuffled.get(1, len(expected)) is None
    for start in range(0, len(expected), 16):
        window = got[start:start + 16]
        assert sorted(map(repr, window)) == sorted(map(repr, expected[start:start + 16]))
    assert shuffled.get(2, 5) != shuffled.get(1, 5) or shuffled.get(2, 6) != shuffled.get(1, 6)  # per epoch


def _epoch_sample_ids(pipeline, steps):
    ids = []
    for _ in range(steps):
        for mb in pipeline.next_step():
            ids.extend(mb["sample_ids"])
    return ids


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
