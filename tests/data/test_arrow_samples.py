"""The memory-mapped reader gives the in-memory reader's samples, order and rejects, from a cache
built once per content, for every source kind (files, save_to_disk folders, the HF cache); nodes
sharing a cache folder never publish a broken copy, and a full or read-only cache is one line."""

import errno
import json
import multiprocessing
import os
import re
import shutil
import socket
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer

from loongforge.cli.errors import cli_errors
from loongforge.config.errors import InputError
from loongforge.data import arrow_samples
from loongforge.data.arrow_samples import ArrowSamples, cache_summary
from loongforge.data.cache import cache_write_problem
from loongforge.data.conversations import FileSamples
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.streaming import StreamingSamples
from tests.data.conftest import COCO_IMAGES, LLAMAFACTORY, good_record, require, write_shared_image_records
from tests.shared_data import SHARED_DATA


def _all(samples):
    return [samples.get(i) for i in range(len(samples))]


def _awkward_files(folder):
    """Files with what the reader must keep exactly: broken and non-UTF-8 JSON lines, blank lines,
    a one-line JSON list (records told apart by ordinal), a pretty-printed list with a broken
    element, parquet rows with image bytes and with paths, JSON lines saved as .json."""
    jpg = sorted(require(COCO_IMAGES).glob("*.jpg"))[0]
    (folder / "img.jpg").write_bytes(jpg.read_bytes())
    good = json.dumps(good_record())
    (folder / "lines.jsonl").write_bytes(
        b"\n".join([good.encode(), b'{"messages": [', b"", b'{"a": "\xff\xfe"}', b"   ", good.encode(), b"[1, 2]"]))
    (folder / "one_line.json").write_text(json.dumps([good_record(), {"conversations": []}, good_record("x.jpg")]))
    pretty = json.dumps([good_record(), good_record()], indent=2).replace('"A photo."', '"A photo." oops', 1)
    (folder / "pretty.json").write_text(pretty)
    (folder / "lines_as.json").write_text(good + "\n" + good + "\n")
    pq.write_table(pa.Table.from_pylist([
        {"conversations": [{"from": "human", "value": "<image>cap?"}, {"from": "gpt", "value": "A cat."}],
         "images": [{"bytes": jpg.read_bytes(), "path": None}]},
        {"conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "x"}],
         "images": [{"bytes": None, "path": "img.jpg"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}], "images": []},
    ]), folder / "rows.parquet")
    return sorted(str(p) for p in folder.iterdir() if p.suffix in (".json", ".jsonl", ".parquet"))


def test_same_samples_order_and_rejects_as_the_in_memory_reader(tmp_path):
    # Every conversation file of ../shared/data (the demo sets, MathVista, arena-hard, COCO's
    # caption dict, alpaca-style records) plus files built to be awkward.
    real = sorted(str(p) for p in SHARED_DATA.rglob("*") if p.suffix in (".json", ".jsonl"))
    assert len(real) >= 15
    (tmp_path / "awkward").mkdir()
    files = real + _awkward_files(tmp_path / "awkward")
    expected, got = _all(FileSamples(files)), _all(ArrowSamples(files, str(tmp_path / "cache")))
    assert len(got) == len(expected) > 30_000
    mismatched = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    assert not mismatched, (mismatched[:3], expected[mismatched[0]], got[mismatched[0]])
    accepted = sum(isinstance(s, ConversationSample) for s in got)
    rejects = [s for s in got if isinstance(s, Reject)]
    print(f"\n{len(got)} records in {len(files)} files: {accepted} samples, {len(rejects)} rejects, all equal")
    assert accepted >= 190 and {r.reason for r in rejects} >= {"malformed_json", "bad_roles", "empty_answer"}
    assert all(r.record is not None for r in rejects)  # every record is named by its ordinal
    ids = [s.sample_id for s in got if isinstance(s, ConversationSample)]
    assert len(set(ids)) == len(ids)  # COCO's captions all start on one line, and a one-line list's records


def test_records_sharing_a_line_have_their_own_ids_in_every_reader(tmp_path):
    """Issue 49: a JSON array on one line, or a COCO captions file, starts every record on one line;
    samples named <file>:<line> all had one id (and one key in a store of embeddings). Named by
    their ordinal, each has its own, the same in the in-memory, Arrow and streaming readers, as
    the same records written as JSON lines have."""
    array, lines = write_shared_image_records(tmp_path)
    coco = tmp_path / "captions.json"
    captions = [{"image_id": 1, "id": i, "caption": f"A cat, {i}."} for i in range(3)]
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "cat.jpg"}], "annotations": captions}))
    read = {}
    for path in (array, lines, coco):
        memory = FileSamples([str(path)])
        arrow = ArrowSamples([str(path)], str(tmp_path / "cache"))
        streamed = StreamingSamples([str(path)], window=4, shuffle=False, seed=0)
        ids = [memory.get(i).sample_id for i in range(len(memory))]
        assert [arrow.get(i).sample_id for i in range(len(arrow))] == ids
        assert [streamed.get(0, p).sample_id for p in range(len(ids))] == ids
        read[path] = ids, sorted({memory.get(i).line for i in range(len(memory))})
    print("\n" + "; ".join(f"{path.name}: {len(set(ids))} distinct ids of {len(ids)} records (lines {lines})"
                           for path, (ids, lines) in read.items()))
    for path, (ids, _) in read.items():
        assert ids == [f"{path}[{record}]" for record in range(len(ids))]  # ordinals: elements, lines - 1


def test_copy_is_built_once_per_content_and_rebuilt_when_it_changes(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(good_record()) + "\n")
    cache = tmp_path / "cache"
    first = ArrowSamples([str(data)], str(cache))
    copies = sorted(cache.rglob("*.arrow"))
    assert len(copies) == 1
    built_at = copies[0].stat().st_mtime_ns
    ArrowSamples([str(data)], str(cache))
    assert sorted(cache.rglob("*.arrow")) == copies and copies[0].stat().st_mtime_ns == built_at
    # Same size, new content (and a new mtime): a new copy, the new record.
    data.write_text(json.dumps(good_record("b.jpg")) + "\n")
    again = ArrowSamples([str(data)], str(cache))
    assert len(list(cache.rglob("*.arrow"))) == 2
    assert first.get(0).images != again.get(0).images and again.get(0).images[0].endswith("b.jpg")
    # A copy of identical content elsewhere maps the same cache file.
    twin = tmp_path / "twin" / "d.jsonl"
    twin.parent.mkdir()
    twin.write_bytes(data.read_bytes())
    assert ArrowSamples([str(twin)], str(cache)).get(0).file == str(twin)
    assert len(list(cache.rglob("*.arrow"))) == 2


def _open_in_process(args):
    path, cache = args
    samples = ArrowSamples([path], cache)
    return len(samples), samples.get(len(samples) - 1).line


def test_processes_starting_together_build_one_copy(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(good_record(f"{i}.jpg")) + "\n" for i in range(50_000)))
    builds = tmp_path / "builds"
    builds.mkdir()
    write_copy = arrow_samples._write_copy

    def counted_write_copy(*args, **kwargs):  # the forked processes inherit this
        (builds / str(os.getpid())).touch()
        write_copy(*args, **kwargs)

    monkeypatch.setattr(arrow_samples, "_write_copy", counted_write_copy)
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_open_in_process, [(str(data), str(tmp_path / "cache"))] * 3)
    assert results == [(50_000, 50_000)] * 3
    assert len(list(builds.iterdir())) == 1
    copies = f"v{arrow_samples.CACHE_FORMAT}"
    left = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.parent.name == copies]
    assert len([f for f in left if f.endswith(".arrow")]) == 1 and not [f for f in left if f.endswith(".tmp")]


def test_save_to_disk_folder_and_hf_cache_dataset(tmp_path, monkeypatch):
    jpg = sorted(require(COCO_IMAGES).glob("*.jpg"))[0].read_bytes()
    records = [
        {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A cat."}],
         "images": [{"bytes": jpg, "path": None}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "images": []},
        {"messages": [{"role": "user", "content": "hi"}], "images": []},
    ]
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),  # decodes to PIL by default: the reader must not
    })
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records, features=features).save_to_disk(str(saved))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "same.parquet")
    expected = _all(FileSamples([str(tmp_path / "same.parquet")]))
    assert [type(s) for s in expected] == [ConversationSample, ConversationSample, Reject]

    def same_as_parquet(got, name):
        assert len(got) == 3
        for want, have in zip(expected, got):
            assert type(have) is type(want) and have.line == want.line and have.file == name
        assert got[0].images == [jpg] and got[1].turns == expected[1].turns and got[2].reason == "bad_roles"

    same_as_parquet(_all(ArrowSamples([str(saved)], str(tmp_path / "cache"))), str(saved))
    # A folder with the saved dataset and the parquet file: two sources, the saved folder's own
    # files (dataset_info.json, state.json) are not read as data.
    both = ArrowSamples([str(tmp_path)], str(tmp_path / "cache"))
    assert len(both) == 6
    # What load_dataset("acme/vlm") leaves in the datasets cache, read offline by name.
    hub = tmp_path / "hf" / "acme___vlm" / "default" / "0.0.0" / "0123abcd"
    hub.mkdir(parents=True)
    arrow = datasets.Dataset.from_list(records, features=features)
    arrow.info.dataset_name, arrow.info.config_name = "vlm", "default"
    arrow.info.splits = datasets.SplitDict({"train": datasets.SplitInfo("train", num_examples=len(records))})
    arrow.info.write_to_directory(str(hub))
    with pa.OSFile(str(hub / "vlm-train.arrow"), "wb") as sink, pa.ipc.new_stream(sink, arrow.data.schema) as w:
        w.write_table(arrow.data.table)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    same_as_parquet(_all(ArrowSamples(["hf:acme/vlm:train"], str(tmp_path / "cache"))), "hf:acme/vlm:train")
    with pytest.raises(InputError, match="hf:acme/other.*cannot be loaded"):
        ArrowSamples(["hf:acme/other"], str(tmp_path / "cache"))


def test_a_dataset_dict_folder_asks_for_a_split(tmp_path):
    rows = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "q"}]}])
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"splits train, test.*dd/train"):
        ArrowSamples([str(tmp_path / "dd")], str(tmp_path / "cache"))
    assert len(ArrowSamples([str(tmp_path / "dd" / "train")], str(tmp_path / "cache"))) == 1


def test_demo_files_resolve_media_as_before(tmp_path):
    files = [str(require(LLAMAFACTORY / "mllm_demo.json")), str(require(LLAMAFACTORY / "v1_multimodal_demo.jsonl"))]
    got = _all(ArrowSamples(files, str(tmp_path / "cache")))
    assert len(got) == 30 and got[6].images == [str(LLAMAFACTORY / "mllm_demo_data" / "1.jpg")] * 2
    assert all(os.path.exists(image) for sample in got for image in sample.images)


def _rss_file_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc accounting")
def test_reads_do_not_leave_the_mapped_copy_in_the_resident_set(tmp_path):
    data = tmp_path / "d.jsonl"
    record = good_record()
    record["messages"][1]["content"] = "x" * 400
    data.write_text((json.dumps(record) + "\n") * 100_000)
    samples = ArrowSamples([str(data)], str(tmp_path / "cache"))
    (part,) = samples._parts
    part.pages.release()
    assert part.pages._ranges  # the copy's mapping was found in /proc/self/maps
    before = _rss_file_kb()
    for index in range(0, 100_000, 97):  # ~1,000 reads spread over the 50 MB copy
        samples.get(index)
    assert _rss_file_kb() - before < 8 * 1024


# ---------------------------------------------------------------- a cache shared by nodes (issue 30)

class _NoLock:
    """A file lock that does not hold across nodes, as on many network file systems."""

    def __init__(self, path):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _build_as_host(path, cache, host, barrier, result):
    """A builder on node ``host`` of a shared cache folder: the same pid as the other node's builder
    (containers), no lock between them, both writing their copies at the same time."""
    socket.gethostname = lambda: host
    os.getpid = lambda: 4242
    arrow_samples.FileLock = _NoLock
    arrow_samples._BATCH_ROWS = 512  # many batches: the two writes interleave
    batches = arrow_samples._jsonl_batches

    def together(*args):  # both have their temp file open before either writes a batch
        barrier.wait(timeout=60)
        yield from batches(*args)

    arrow_samples._jsonl_batches = together
    try:
        samples = ArrowSamples([path], cache, progress=False)
        outcome = {"rows": len(samples), "last": samples.get(len(samples) - 1).images}
    except Exception as error:  # reported to the test, which shows it
        outcome = {"error": repr(error)}
    Path(result).write_text(json.dumps(outcome))


def test_two_hosts_with_one_pid_build_one_cache_at_once(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(good_record(f"{i}.jpg")) + "\n" for i in range(8_000)))
    cache = tmp_path / "cache"
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    builders = [context.Process(target=_build_as_host, args=(str(data), str(cache), host, barrier,
                                                             str(tmp_path / f"{host}.json")))
                for host in ("node-a", "node-b")]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join(timeout=120)
    outcomes = [json.loads((tmp_path / f"{host}.json").read_text()) for host in ("node-a", "node-b")]
    print(f"\n{outcomes}")
    assert outcomes == [{"rows": 8_000, "last": [str(tmp_path / "7999.jpg")]}] * 2
    left = sorted(p.name for p in (cache / f"v{arrow_samples.CACHE_FORMAT}").iterdir())
    assert len([name for name in left if name.endswith(".arrow")]) == 1 and not [n for n in left if ".tmp" in n]
    assert _all(ArrowSamples([str(data)], str(cache))) == _all(FileSamples([str(data)]))  # the published copy


def test_a_rewrite_in_place_with_the_same_size_and_mtime_is_a_new_copy(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(good_record("a.jpg")) + "\n")
    cache = str(tmp_path / "cache")
    assert ArrowSamples([str(data)], cache).get(0).images == [str(tmp_path / "a.jpg")]
    before = data.stat()
    with open(data, "r+b") as f:  # same inode, same size
        f.write(data.read_bytes().replace(b"a.jpg", b"b.jpg"))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # as a copy tool preserving times leaves it
    after = data.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert ArrowSamples([str(data)], cache).get(0).images == [str(tmp_path / "b.jpg")]


def test_a_copy_that_lost_rows_is_not_published(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(good_record(f"{i}.jpg")) + "\n" for i in range(5_000)))
    rows_in = arrow_samples._rows_in

    def truncated_meanwhile(copy):  # as a writer that shares the file would leave it
        with open(copy, "r+b") as f:
            f.truncate(copy.stat().st_size // 2)
        return rows_in(copy)

    monkeypatch.setattr(arrow_samples, "_rows_in", truncated_meanwhile)
    monkeypatch.setattr(arrow_samples, "_BATCH_ROWS", 1024)
    with pytest.raises(RuntimeError, match=r"came out holding (\d+ rows|an unreadable file), not 5000 rows .* "
                                           r"it was not published"):
        ArrowSamples([str(data)], str(tmp_path / "cache"))
    copies = tmp_path / "cache" / f"v{arrow_samples.CACHE_FORMAT}"
    assert [p.name for p in copies.iterdir() if not p.name.endswith(".lock")] == []


def test_a_full_or_read_only_cache_is_one_line(tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(good_record()) + "\n")
    cache = tmp_path / "cache"

    def one_line(expected: str) -> None:
        with pytest.raises(typer.Exit) as exit_, cli_errors():
            ArrowSamples([str(data)], str(cache))
        lines = capsys.readouterr().err.strip().splitlines()
        print(lines)
        assert exit_.value.exit_code == 2 and lines == [f"error: {expected}"]

    with monkeypatch.context() as patch:
        patch.setattr(arrow_samples.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 10**12 - 100, 100))
        one_line(f"data.cache_dir {cache} is full: the Arrow copy of {data} needs about {data.stat().st_size} B, "
                 "100 B is free; free space there or point data.cache_dir (or LOONGFORGE_CACHE) at a larger "
                 "node-local disk")

    class ReadOnlyLock(_NoLock):  # what filelock meets on a read-only mount
        def __init__(self, path):
            self.path = path

        def __enter__(self):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), self.path)

    with monkeypatch.context() as patch:
        patch.setattr(arrow_samples, "FileLock", ReadOnlyLock)
        one_line(f"data.cache_dir {cache} is not writable (Read-only file system) while making the Arrow copy of "
                 f"{data}; point data.cache_dir (or LOONGFORGE_CACHE) at a writable node-local folder")

    # A read-only cache of copies built before serves them (its key memo cannot be written: no matter).
    ArrowSamples([str(data)], str(cache))
    os.utime(data)  # a new mtime: the memo is looked up again and written again

    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(arrow_samples, "write_cache_file", read_only)
    assert len(ArrowSamples([str(data)], str(cache))) == 1
    # A data file that cannot be read is its own problem, not the cache's.
    assert cache_write_problem(PermissionError(errno.EACCES, "Permission denied", str(data)), cache, "x") is None
    unreadable = OSError(f"Failed to open local file '{data}'. Detail: [errno 13] Permission denied")  # pyarrow's
    assert cache_write_problem(unreadable, cache, "x") is None
    no_space = OSError("IOError: error writing to /x: No space left on device")  # pyarrow's: no errno
    assert cache_write_problem(no_space, cache, "writing").startswith(
        f"data.cache_dir {cache} is full (No space left on device) while writing; free space there")


def test_the_start_up_line_says_where_the_cache_is_and_how_big(tmp_path):
    cache = tmp_path / "cache"
    assert cache_summary(str(cache)).startswith(f"cache: {cache}, 0 Arrow copies (0 B), ")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(good_record(f"{i}.jpg")) + "\n" for i in range(1_000)))
    ArrowSamples([str(data)], str(cache))
    (copy,) = (cache / f"v{arrow_samples.CACHE_FORMAT}").glob("*.arrow")
    line = cache_summary(str(cache))
    print(f"\n{line}")
    assert re.fullmatch(rf"cache: {cache}, 1 Arrow copy \({copy.stat().st_size / 1000:.1f} KB\), [\d.]+ [KMGT]?B free",
                        line)
