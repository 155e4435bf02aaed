"""Checkpoints record the data files' fingerprints: a resume on a changed file refuses in one line
naming it (Arrow indices and streaming byte offsets alike), a moved file with the same bytes resumes
as before, and data.accept_changed_files continues from the recorded sample count."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.fingerprint import check_files, counted_position, first_change, source_fingerprint
from loongforge.data.pipeline import DataPipeline
from tests.data.test_pipeline import _assert_same_batches


def _chat(i: int, words: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i} " + "word " * words},
                         {"role": "assistant", "content": f"answer {i}"}]}


def _write_inputs(folder) -> list[str]:
    """JSON lines, a JSON list and parquet: 150 records."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps(_chat(i, i % 37)) + "\n" for i in range(100)))
    (folder / "b.json").write_text(json.dumps([_chat(100 + i, i) for i in range(30)], indent=1))
    pq.write_table(pa.Table.from_pylist([_chat(130 + i, 2 * i) for i in range(20)]), folder / "c.parquet")
    return [str(folder / name) for name in ("a.jsonl", "b.json", "c.parquet")]


def _pipeline(tokenizer, paths, cache, **overrides):
    cfg = DataConfig(**{"source": "files", "paths": paths, "cache_dir": str(cache), "shuffle_window": 16,
                        "seq_len": 256, "num_workers": 0, "seed": 3, **overrides})
    return DataPipeline(cfg, ModelConfig(family="qwen2_5_vl"), global_batch_size=4, dp_rank=0, dp_size=1, pad_to_multiple=8,
                        tokenizer=tokenizer, lookahead=8)


def _rewrite_in_place(path, old: bytes, new: bytes) -> None:
    """Same size, same mtime, same inode: only the bytes differ."""
    assert len(old) == len(new)
    stat = os.stat(path)
    content = path.read_bytes()
    assert content.count(old) == 1
    with open(path, "r+b") as f:
        f.write(content.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("streaming", [False, True], ids=["arrow", "streaming"])
def test_resume_on_a_changed_file_refuses_naming_it_and_continues_when_accepted(tokenizer, tmp_path, streaming):
    paths = _write_inputs(tmp_path / "data")
    first = _pipeline(tokenizer, paths, tmp_path / "cache", streaming=streaming)
    for _ in range(3):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    kind = "head_tail" if streaming else "content"
    assert [f["file"] for f in state["files"]] == paths and all(kind in f for f in state["files"])

    # Moved, same bytes: the same samples as the uninterrupted run.
    moved = _write_inputs(tmp_path / "moved")
    expected = [first.next_step() for _ in range(2)]
    resumed = _pipeline(tokenizer, moved, tmp_path / "cache", streaming=streaming)
    resumed.load_state_dict(state)
    assert resumed.resume_note is None
    for batches in expected:  # sample ids name the file: the moved one
        got = [{**mb, "sample_ids": [i.replace("/moved/", "/data/") for i in mb["sample_ids"]]}
               for mb in resumed.next_step()]
        _assert_same_batches(got, batches)

    # One record rewritten in place (same size, mtime and inode): refused in one line naming it.
    _rewrite_in_place(tmp_path / "moved" / "b.json", b"question 101 ", b"question 909 ")
    with pytest.raises(InputError) as refused:
        _pipeline(tokenizer, moved, tmp_path / "cache", streaming=streaming).load_state_dict(state)
    message = str(refused.value)
    print(f"\n{message}")
    assert "\n" not in message and message.startswith(
        f"data file {moved[1]} (recorded as {paths[1]}) changed since the checkpoint (same size, different content)")
    assert message.endswith("set data.accept_changed_files=true to continue from the recorded sample count in "
                            "the changed data")

    accepted = _pipeline(tokenizer, moved, tmp_path / "cache", streaming=streaming, accept_changed_files=True)
    accepted.load_state_dict(state)
    assert accepted.resume_note.endswith(
        f"continuing at epoch {state['stream']['epoch']}, sample {state['stream']['cursor']} of the changed data")
    accepted.next_step()
    after = accepted.state_dict()
    assert after["files"][1] != state["files"][1]  # its checkpoints record the changed file
    _pipeline(tokenizer, moved, tmp_path / "cache", streaming=streaming).load_state_dict(after)


def test_a_checkpoint_without_fingerprints_still_loads(tokenizer, tmp_path):
    paths = _write_inputs(tmp_path / "data")
    first = _pipeline(tokenizer, paths, tmp_path / "cache")
    first.next_step()
    state = first.state_dict()
    del state["files"]  # as checkpoints saved before fingerprints hold it
    _pipeline(tokenizer, paths, tmp_path / "cache").load_state_dict(state)


def test_changes_in_words(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"y" * 10)
    before = [source_fingerprint(str(a)), source_fingerprint(str(b))]
    assert first_change(before, before) is None
    with open(a, "r+b") as f:  # the last MiB is hashed too
        f.seek(2_999_000)
        f.write(b"z")
    after = [source_fingerprint(str(a)), source_fingerprint(str(b))]
    assert first_change(before, after) == f"data file {a} changed since the checkpoint (same size, different content)"
    b.write_bytes(b"y" * 11)
    assert first_change(before[1:], [source_fingerprint(str(b))]).endswith("(size 10 -> 11 bytes)")
    assert first_change(before, before[:1]) == f"data.paths source {b} is gone since the checkpoint (2 sources then, 1 now)"
    assert first_change(before[:1], before).startswith(f"data.paths source {b} is new since the checkpoint")
    assert check_files(None, after, accept_changed=False) is None  # nothing recorded: nothing to compare
    assert check_files(before, after, accept_changed=True).startswith(f"data file {a} changed")


def test_the_recorded_sample_count_in_changed_data():
    streaming = {"epoch": 1, "cursor": 40, "buffer": [[1, 30]], "window_starts": {"2": [0, 900, 33]}}
    assert counted_position(streaming, count=None, first=0) == {
        "epoch": 1, "cursor": 40, "buffer": [], "window_starts": {}}
    indexed = {"epoch": 2, "cursor": 41, "buffer": [[2, 39]]}
    assert counted_position(indexed, count=100, first=1) == {"epoch": 2, "cursor": 41, "buffer": []}
    assert counted_position(indexed, count=40, first=1) == {"epoch": 3, "cursor": 1, "buffer": []}  # data shrank
