"""Weighted data mixtures (``path@weight`` in data.paths): shares, determinism, exact resume, the
re-deal at another DP size, streaming, and the one-line errors."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.conversations import expand_data_paths
from loongforge.data.measure import SampleMeasurer
from loongforge.data.mixture import Mixture, build_mixture, entry_weights, parse_entry, source_names
from loongforge.data.pipeline import DataPipeline, RejectLog, RowStream
from loongforge.data.samples import sample_file
from loongforge.data.streaming import StreamingSamples
from tests.data.conftest import good_record, write_conversations

MODEL = ModelConfig(family="qwen2_5_vl")
SEQ_LEN = 256


@pytest.fixture()
def two_sources(tmp_path):
    """``a.jsonl`` (60 samples) and ``b.jsonl`` (100 samples): weighted 3:1, ``a`` runs out first."""
    return [str(write_conversations(tmp_path / "a.jsonl", 60)), str(write_conversations(tmp_path / "b.jsonl", 100))]


def _stream(tokenizer, paths, tmp_path, *, seed=7, shard=(0, 1), shuffle=True):
    cfg = DataConfig(source="files", paths=paths, seq_len=SEQ_LEN, seed=seed, cache_dir=str(tmp_path / "cache"))
    samples = ArrowSamples(paths, cfg.cache_dir, progress=False)
    mixture = build_mixture(paths, samples.entry_spans(), seed=seed, shuffle=shuffle)
    return RowStream(samples, SampleMeasurer(tokenizer, cfg, MODEL), seq_len=SEQ_LEN, lookahead=8, shuffle=shuffle,
                     seed=seed, rejects=RejectLog(None), shard=shard, mixture=mixture, names=source_names(paths))


def _trained(stream, count: int) -> list[str]:
    """Sample ids of the rows the stream gives until ``count`` samples were trained."""
    ids: list[str] = []
    while len(ids) < count:
        ids.extend(item.payload.sample_id for item in stream.next_row())
    return ids


def _shares(ids: list[str]) -> dict[str, float]:
    files = Counter(Path(sample_file(sample_id)).name for sample_id in ids)
    return {name: n / len(ids) for name, n in sorted(files.items())}


def test_three_to_one_over_200_samples_is_within_2_percent_and_seeded(tokenizer, two_sources, tmp_path):
    weighted = [f"{two_sources[0]}@3", f"{two_sources[1]}@1"]
    stream = _stream(tokenizer, weighted, tmp_path)
    ids = _trained(stream, 200)
    shares = _shares(ids[:200])
    print(f"3:1 mixture, first 200 samples trained: shares {shares} (want a 0.75, b 0.25)")
    assert abs(shares["a.jsonl"] - 0.75) <= 0.02 and abs(shares["b.jsonl"] - 0.25) <= 0.02
    # a (60 samples) is in its third epoch by now: every one of its samples came back.
    assert len({i for i in ids if "a.jsonl" in i}) == 60
    counted = stream.source_report()
    print(f"the stream's own counts after {len(ids)} samples: {counted}")
    assert [counted[p]["samples"] for p in two_sources] == [sum(p in i for i in ids) for p in two_sources]
    # epochs: the draws up to the stream's position less what the packer holds, about the 206 trained
    assert abs(counted[two_sources[0]]["epochs"] - 206 * 0.75 / 60) < 0.05
    assert abs(counted[two_sources[1]]["epochs"] - 206 * 0.25 / 100) < 0.02
    assert _trained(_stream(tokenizer, weighted, tmp_path), 200) == ids  # same seed: same samples
    other = _trained(_stream(tokenizer, weighted, tmp_path, seed=8), 200)
    print(f"seed 8: {sum(x != y for x, y in zip(ids[:200], other[:200]))} of 200 positions differ; shares {_shares(other[:200])}")
    assert other[:200] != ids[:200]


def test_shares_are_exact_over_every_window_of_draws():
    mixture = Mixture([7, 3], [13, 1000], [0, 13], seed=1, shuffle=True)
    sources = mixture.sources(np.arange(5000))
    worst = max(abs(int((sources[s:s + n] == 0).sum()) - 0.7 * n)
                for n in (10, 57, 200, 1001) for s in range(0, 4000, 37))
    print(f"7:3 mixture: largest miss of a source's share over any window: {worst:.1f} draws")
    assert worst <= 1.0
    # each source's epochs visit every one of its samples once
    first = mixture.indices(0, 400)
    small = first[first < 13]
    assert sorted(small[:13].tolist()) == list(range(13)) and sorted(small[13:26].tolist()) == list(range(13))
    assert mixture.indices(100, 50).tolist() == first[100:150].tolist()  # any stretch, computed directly


@pytest.mark.parametrize("through", ["stream", "pipeline"])
def test_stop_and_resume_continues_the_same_sequence(tokenizer, two_sources, tmp_path, through):
    weighted = [f"{two_sources[0]}@3", f"{two_sources[1]}@1"]
    if through == "stream":
        first = _stream(tokenizer, weighted, tmp_path)
        _trained(first, 90)
        state = json.loads(json.dumps(first.state_dict()))
        expected = _trained(first, 150)
        resumed = _stream(tokenizer, weighted, tmp_path)
        resumed.load_state_dict(state)
        assert _trained(resumed, 150) == expected
        assert resumed.source_report() == first.source_report()
        print(f"resumed at block {state['epoch']} draw {state['cursor']}: counts {resumed.source_report()}")
        return
    cfg = DataConfig(source="files", paths=weighted, seq_len=SEQ_LEN, seed=3, num_workers=1,
                     cache_dir=str(tmp_path / "cache"))
    first = DataPipeline(cfg, MODEL, global_batch_size=4, dp_rank=0, dp_size=1, pad_to_multiple=16,
                         tokenizer=tokenizer)
    for _ in range(5):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    expected = [first.next_step()[0]["input_ids"] for _ in range(6)]
    resumed = DataPipeline(cfg, MODEL, global_batch_size=4, dp_rank=0, dp_size=1, pad_to_multiple=16,
                           tokenizer=tokenizer)
    resumed.load_state_dict(state)
    assert all(np.array_equal(resumed.next_step()[0]["input_ids"], e) for e in expected)
    assert resumed.last_sources == first.last_sources
    print(f"pipeline resumed at step 5, counts after step 11: {resumed.last_sources}")
    first.close()
    resumed.close()


def test_resume_with_other_weights_is_refused(tokenizer, two_sources, tmp_path):
    stream = _stream(tokenizer, [f"{two_sources[0]}@3", f"{two_sources[1]}@1"], tmp_path)
    _trained(stream, 20)
    state = stream.state_dict()
    for paths in ([f"{two_sources[0]}@1", f"{two_sources[1]}@1"], two_sources):
        other = _stream(tokenizer, paths, tmp_path) if "@" in paths[0] else RowStream(
            ArrowSamples(paths, str(tmp_path / "cache"), progress=False),
            SampleMeasurer(tokenizer, DataConfig(seq_len=SEQ_LEN), MODEL), seq_len=SEQ_LEN, lookahead=8,
            shuffle=True, seed=7, rejects=RejectLog(None))
        with pytest.raises(InputError, match="saved with data.paths weights") as error:
            other.load_state_dict(state)
        print(error.value)


def test_sharded_reading_and_a_redeal_train_every_draw_once(tokenizer, two_sources, tmp_path):
    """Two shards read alternate draws; saved and dealt again to three, the union over the restart
    is the single reader's draws, each once."""
    weighted = [f"{two_sources[0]}@3", f"{two_sources[1]}@1"]
    old = [_stream(tokenizer, weighted, tmp_path, shard=(i, 2)) for i in range(2)]
    keys = []
    for stream in old:
        for _ in range(6):
            keys += [tuple(item.key) for item in stream.next_row()]
    states = json.loads(json.dumps([stream.state_dict() for stream in old]))
    new = [_stream(tokenizer, weighted, tmp_path, shard=(i, 3)) for i in range(3)]
    for stream in new:
        stream.load_state_dict(stream.redealt(states))
    later_block = max(s["epoch"] for s in states) + 1
    for stream in new:
        while stream.epoch <= later_block:
            keys += [tuple(item.key) for item in stream.next_row()]
    whole = [k for k in keys if k[0] < later_block]
    print(f"{len(whole)} draws of blocks < {later_block} trained over the restart, {len(set(whole))} distinct")
    assert len(whole) == len(set(whole)) == later_block * 160
    total = sum(stream.counts.samples[0] + stream.counts.samples[1] for stream in new)
    assert total == len(keys)  # shard 0 carried on the old shards' counts


def test_streaming_mixes_by_weight_and_restarts_a_used_up_entry(two_sources, tmp_path):
    weighted = [f"{two_sources[0]}@3", f"{two_sources[1]}@1"]
    samples = StreamingSamples(weighted, window=32, shuffle=True, seed=1)
    files = []
    for position in range(10_000):
        sample = samples.get(0, position)
        if sample is None:
            break
        files.append(Path(sample.file).name)
        assert samples.source_of(0, position) == (files[-1] == "b.jsonl")
    head = Counter(files[:200])
    print(f"streamed 3:1 mixture: epoch of {len(files)} records, first 200: {dict(head)}")
    assert abs(head["a.jsonl"] / 200 - 0.75) <= 0.02
    # The epoch ends once b (100 records, a quarter of the draws) has been read through: with the
    # pattern a a b a, b's last record is draw 399, after 299 of a's (five passes over a, less one).
    assert Counter(files) == {"a.jsonl": 299, "b.jsonl": 100}
    unweighted = StreamingSamples(two_sources, window=32, shuffle=True, seed=1)
    assert sum(unweighted.get(0, p) is not None for p in range(200)) == 160  # no weights: each record once


def test_bad_weights_are_one_line_naming_the_entry(two_sources, tmp_path):
    a, b = two_sources
    (tmp_path / "empty").mkdir()
    cases = {(f"{a}@3", b): f"{b!r} has no weight while others have one",
             (f"{a}@0", f"{b}@1"): "has weight 0; weights must be above 0",
             (f"{a}@-2",): "has weight -2",
             (f"{a}@1", f"{tmp_path / 'empty'}@1"): "does not exist|holds no samples|nothing to read"}
    for paths, message in cases.items():
        with pytest.raises(InputError, match=message) as error:
            samples = ArrowSamples(list(paths), str(tmp_path / "cache"), progress=False)
            build_mixture(list(paths), samples.entry_spans(), seed=1, shuffle=True)
        assert "\n" not in str(error.value)
        print(error.value)
    assert parse_entry("me@home.jsonl").path == "me@home.jsonl"  # not a number: part of the path
    assert entry_weights([f"{a}@0.7", f"{b}@0.3"]) == [7, 3]
    assert expand_data_paths([f"{a}@3", f"{b}@1"]) == [a, b]


def test_pack_holds_the_mix(two_sources, tmp_path):
    from loongforge.pack.job import PackOptions, run_pack

    weighted = [f"{two_sources[0]}@3", f"{two_sources[1]}@1"]
    options = dict(output=tmp_path / "packed", preset="llm-tiny-small-vocab", seq_len=SEQ_LEN, progress=False)
    stats = run_pack(PackOptions(inputs=tuple(weighted), **options)).stats
    manifest = [json.loads(line) for line in (tmp_path / "packed" / "manifest.jsonl").read_text().splitlines()]
    files = Counter(Path(s["file"]).name for pack in manifest for s in pack["samples"])
    print(f"pack of a 3:1 mixture of 60 + 100 samples: {dict(files)} in {stats['packs']} packs; "
          f"stats sources {stats['sources']}")
    assert files == {"a.jsonl": 120, "b.jsonl": 40}  # 160 draws, 3:1
    assert [stats["sources"][p]["samples"] for p in two_sources] == [120, 40]
    config = json.loads((tmp_path / "packed" / "pack_config.json").read_text())
    assert config["mixture"]["weights"] == [3, 1]
    plain = run_pack(PackOptions(inputs=tuple(two_sources), **{**options, "output": tmp_path / "plain"})).stats
    assert plain["samples_packed"] == 160 and "sources" not in plain  # no weights: every sample once


def test_streamed_mixture_counts_sources_and_resumes_exactly(tokenizer, two_sources, tmp_path):
    from loongforge.data.packing import LookaheadPacker
    from loongforge.data.streaming import StreamingRowStream

    weighted = [f"{two_sources[0]}@3", f"{two_sources[1]}@1"]
    cfg = DataConfig(source="files", paths=weighted, seq_len=SEQ_LEN, streaming=True)

    def stream(paths=weighted):
        return StreamingRowStream(StreamingSamples(paths, window=16, shuffle=True, seed=2),
                                  SampleMeasurer(tokenizer, cfg, MODEL), packer=LookaheadPacker(SEQ_LEN, 8),
                                  rejects=RejectLog(None), shard=(0, 1))

    first = stream()
    _trained(first, 100)
    state = json.loads(json.dumps(first.state_dict()))
    expected = _trained(first, 150)
    resumed = stream()
    resumed.load_state_dict(state)
    assert _trained(resumed, 150) == expected
    report = resumed.source_report()
    print(f"streamed mixture, counts after resuming: {report}")
    assert report == first.source_report()
    # Issue 49: each entry's epochs, its records drawn (no rejects here) over its records; None while
    # its first pass is read (b, 64 of 100 drawn): its size is not known before.
    assert [report[p]["epochs"] for p in two_sources] == [round(report[two_sources[0]]["samples"] / 60, 4), None]
    later = stream()
    later.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    _trained(later, 200)
    later = later.source_report()
    print(f"streamed mixture, 200 samples later: {later}")
    assert [later[p]["epochs"] for p in two_sources] == [round(later[p]["samples"] / n, 4)
                                                         for p, n in zip(two_sources, (60, 100))]
    assert [report[p]["samples"] for p in two_sources] == [sum(p in i for i in expected) + n for p, n in
                                                           zip(two_sources, state["sources"]["samples"])]
    with pytest.raises(InputError, match=r"saved with data.paths weights \[3, 1\], this run has \[1, 1\]"):
        stream([f"{two_sources[0]}@1", f"{two_sources[1]}@1"]).load_state_dict(state)


def _images_missing(path: Path, count: int) -> Path:
    """``count`` one-image conversations whose image files do not exist, and one malformed line."""
    path.write_text("".join(json.dumps(good_record(f"gone/{i}.jpg")) + "\n" for i in range(count)) + "{oops\n")
    return path


def test_a_source_whose_every_sample_is_rejected_stops_before_training(tokenizer, two_sources, tmp_path):
    """Issue 49: an entry none of whose samples could be trained gave its share to the others,
    silently. Now one line names it and its reasons before the first row is packed."""
    missing = _images_missing(tmp_path / "images_gone.jsonl", 5)
    with pytest.raises(InputError) as error:
        _stream(tokenizer, [f"{two_sources[0]}@1", f"{missing}@1"], tmp_path)
    print(error.value)
    assert str(error.value) == (f"data.paths entry {str(missing)!r}: all 6 samples were rejected (malformed_json: 1, "
                                "missing_image: 5); fix them or drop the entry (its weight would go to the other "
                                "entries)")
    usable = tmp_path / "one_usable.jsonl"  # one sample of 7 trainable: no error, it trains that one
    usable.write_text(missing.read_text() + Path(two_sources[1]).read_text().splitlines()[0] + "\n")
    ids = _trained(_stream(tokenizer, [f"{two_sources[0]}@1", f"{usable}@1"], tmp_path), 40)
    assert len({i for i in ids if "one_usable" in i}) == 1 and sum("one_usable" in i for i in ids) > 1


def _streamed(tokenizer, paths, shard=(0, 1)):
    from loongforge.data.packing import LookaheadPacker
    from loongforge.data.streaming import StreamingRowStream

    cfg = DataConfig(source="files", paths=paths, seq_len=SEQ_LEN, streaming=True)
    return StreamingRowStream(StreamingSamples(paths, window=16, shuffle=True, seed=2),
                              SampleMeasurer(tokenizer, cfg, MODEL), packer=LookaheadPacker(SEQ_LEN, 8),
                              rejects=RejectLog(None), shard=shard)


@pytest.mark.parametrize("shard", [(0, 1), (1, 2)])
def test_a_streamed_entry_whose_every_record_is_rejected_stops_once_read_through(tokenizer, two_sources, tmp_path,
                                                                                shard):
    """Issue 49, streamed: the entry's 6 records end their first pass in window 0 (of 16 records):
    the stream stops as it enters window 1, whichever shard's share it reads."""
    missing = _images_missing(tmp_path / "images_gone.jsonl", 5)
    stream = _streamed(tokenizer, [f"{two_sources[0]}@1", f"{missing}@1"], shard)
    with pytest.raises(InputError) as error:
        _trained(stream, 200)
    print(f"shard {shard}, stopped at position {stream.cursor}: {error.value}")
    assert str(error.value) == (f"data.paths entry {str(missing)!r}: all 6 records were rejected (malformed_json: 1, "
                                "missing_image: 5); fix them or drop the entry (its weight would go to the other "
                                "entries)")
    assert stream.epoch == 0 and stream.cursor <= 16 + shard[1]
    usable = tmp_path / "one_usable.jsonl"  # one record of 7 trainable: no shard stops
    usable.write_text(missing.read_text() + Path(two_sources[1]).read_text().splitlines()[0] + "\n")
    stream = _streamed(tokenizer, [f"{two_sources[0]}@1", f"{usable}@1"], shard)
    _trained(stream, 150)
    assert stream.epoch >= 1
