"""The memory-mapped reader gives the in-memory reader's samples, order and rejects, from a cache
built once per content, for every source kind (files, save_to_disk folders, the HF cache)."""

import json
import multiprocessing
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loongforge.config.errors import InputError
from loongforge.data import arrow_samples
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.conversations import FileSamples
from loongforge.data.samples import ConversationSample, Reject
from tests.data.conftest import COCO_IMAGES, LLAMAFACTORY, good_record, require
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
    assert any(r.record is not None for r in rejects)  # the one-line list's bad element keeps its ordinal


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
    left = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.parent.name == "v1"]
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
