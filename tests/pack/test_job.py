"""run_pack end to end on real files: accounting, capacity, determinism, resume, errors."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from loongforge.config.errors import ConfigError, InputError
from loongforge.data.conversations import FileSamples, read_json_array
from loongforge.data.packfile import folder
from loongforge.data.packfile.reader import PackedFolder
from loongforge.data.samples import REJECT_REASONS
from loongforge.data.tokenizer import load_tokenizer
from loongforge.pack.job import PackOptions, run_pack
from tests.pack.conftest import BAD_LINES, PRESET, SEQ_LEN, folder_bytes
from tests.shared_data import REPO_ROOT, SHARED_DATA


def _options(inputs, output, **overrides):
    settings = dict(inputs=tuple(inputs), output=Path(output), preset=PRESET, seq_len=SEQ_LEN, packs_per_shard=2,
                    progress=False)
    return PackOptions(**{**settings, **overrides})


def _manifest(root):
    return folder.read_lines(root / folder.MANIFEST_FILE)


def test_every_sample_packed_once_or_rejected(pack_inputs, tmp_path):
    root = tmp_path / "out"
    stats = run_pack(_options(pack_inputs, root)).stats
    manifest, rejects = _manifest(root), folder.read_lines(root / folder.REJECTS_FILE)
    packed = [(s["file"], s["line"]) for pack in manifest for s in pack["samples"]]
    rejected = [(r["file"], r["line"]) for r in rejects]
    inputs = FileSamples(pack_inputs)
    expected = [(str(path), located.line) for path, located in inputs._entries]
    assert sorted(packed + rejected) == sorted(expected) and len(set(packed + rejected)) == len(expected)
    assert stats["samples_in"] == len(expected) == stats["samples_packed"] + stats["samples_rejected"]
    assert stats["samples_packed"] == len(packed) and stats["samples_rejected"] == len(rejected)
    assert stats["packs"] == len(manifest) and [p["pack"] for p in manifest] == list(range(len(manifest)))
    # Every reason is exercised by a real malformed input, at the line that carries it.
    # (missing_embedding needs a store of embeddings, which pack does not read; media_in_text_model
    # a text-only model: test_text_model_packs_text_and_rejects_media; video_in_image_model and beyond_vocabulary
    # an image-only model and a tokenizer past its embedding: tests/data/test_internvl_data.py)
    assert all(stats["rejects_by_reason"][reason] >= 1 for reason in REJECT_REASONS
               if reason not in ("missing_embedding", "media_in_text_model", "video_in_image_model",
                                 "beyond_vocabulary"))
    bad = {r["line"]: r["reason"] for r in rejects if r["file"].endswith("bad.jsonl")}
    assert bad == BAD_LINES
    assert {(r["line"], r["reason"]) for r in rejects if r["file"].endswith("broken.json")} == {(3, "malformed_json")}
    assert all(r["detail"] for r in rejects)
    packed_samples = [s for pack in manifest for s in pack["samples"]]
    assert all(isinstance(entry["record"], int) for entry in rejects + packed_samples)  # named by their ordinal
    real_tokens = sum(p["tokens"] for p in manifest)
    assert stats["fill_ratio"] == round(real_tokens / (len(manifest) * SEQ_LEN), 6)


def test_text_model_packs_text_and_rejects_media(tmp_path):
    """A text-only preset packs the text-only conversations and counts each one with images or a
    video as a media_in_text_model reject, with its file and line."""
    mix = SHARED_DATA / "loongforge" / "vlm" / "mix.json"
    root = tmp_path / "out"
    stats = run_pack(_options([mix], root, preset="llm-tiny")).stats
    rejects = folder.read_lines(root / folder.REJECTS_FILE)
    records = read_json_array(mix.read_text())
    with_media = {r.line for r in records if r.record.get("images") or r.record.get("videos")}
    assert with_media and len(with_media) < len(records)
    assert {(r["line"], r["reason"]) for r in rejects} == {(line, "media_in_text_model") for line in with_media}
    packed = [s["line"] for pack in _manifest(root) for s in pack["samples"]]
    assert sorted(packed) == sorted({r.line for r in records} - with_media)
    assert stats["samples_rejected"] == len(with_media)


def test_records_of_a_one_line_json_list_keep_their_ordinal(tmp_path):
    """A JSON list written on one line: all its records start on line 1, so each reject, manifest
    entry and packed sample also names its record (ordinal in the file)."""
    bad_roles = {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}
    bad_roles_too = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}
    empty_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}
    good = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]}
    data = tmp_path / "one_line.json"
    data.write_text(json.dumps([bad_roles, good, bad_roles_too, empty_answer]))
    root = tmp_path / "out"
    stats = run_pack(_options([str(data)], root)).stats
    rejects = folder.read_lines(root / folder.REJECTS_FILE)
    assert [(r["file"], r["line"], r["record"], r["reason"]) for r in rejects] == [
        (str(data), 1, 0, "bad_roles"), (str(data), 1, 2, "bad_roles"), (str(data), 1, 3, "empty_answer")]
    assert stats["samples_rejected"] == 3 and stats["samples_packed"] == 1
    assert {k: v for k, v in stats["rejects_by_reason"].items() if v} == {"bad_roles": 2, "empty_answer": 1}
    [pack] = _manifest(root)
    assert [(s["line"], s["record"], s["index"]) for s in pack["samples"]] == [(1, 1, 1)]
    [sample] = PackedFolder(root).pack(0)
    assert (sample.file, sample.line, sample.record) == (str(data), 1, 1)


def test_packs_fit_and_shards_match_manifest(pack_inputs, tmp_path):
    root = tmp_path / "out"
    run_pack(_options(pack_inputs, root, algorithm="balanced", max_images_per_pack=3))
    for pack in _manifest(root):
        assert pack["tokens"] == sum(s["tokens"] for s in pack["samples"]) <= SEQ_LEN
        assert sum(s["images"] + s["videos"] for s in pack["samples"]) <= 3
        row = pq.ParquetFile(root / pack["shard"]).read_row_group(pack["row"]).to_pylist()[0]
        assert row["pack"] == pack["pack"] and row["sample_ids"] == [s["id"] for s in pack["samples"]]
        assert [len(ids) for ids in row["input_ids"]] == [s["tokens"] for s in pack["samples"]]
        for sample, grids in zip(pack["samples"], row["image_grid_thw"]):
            assert sample["patches"][: sample["images"]] == [t * h * w for t, h, w in grids]
            assert len(grids) == sample["images"]


def test_group_by_media_keeps_kinds_apart(pack_inputs, tmp_path):
    root = tmp_path / "out"
    run_pack(_options(pack_inputs, root, group_by_media=True))
    for pack in _manifest(root):
        kinds = {"video" if s["videos"] else "image" if s["images"] else "text" for s in pack["samples"]}
        assert len(kinds) == 1


def test_byte_identical_across_runs_and_worker_counts(pack_inputs, tmp_path):
    run_pack(_options(pack_inputs, tmp_path / "a", workers=1))
    run_pack(_options(pack_inputs, tmp_path / "b", workers=2))
    a, b = folder_bytes(tmp_path / "a"), folder_bytes(tmp_path / "b")
    assert a.keys() == b.keys() and "stats.json" in a and any(k.endswith(".parquet") for k in a)
    assert a == b


class _Interrupt(Exception):
    pass


def _fail_at(stage, unit):
    def fault(current_stage, current_unit):
        if (current_stage, current_unit) == (stage, unit):
            raise _Interrupt(f"{stage} {unit}")
    return fault


# Small packs and one pack per shard: several scan chunks and shards from a few dozen samples.
SMALL = dict(seq_len=512, packs_per_shard=1)


@pytest.mark.parametrize("stage", ["scan", "write"])
def test_resume_after_interruption_equals_uninterrupted(pack_inputs, tmp_path, monkeypatch, stage):
    monkeypatch.setattr(folder, "SCAN_CHUNK", 5)
    run_pack(_options(pack_inputs, tmp_path / "reference", **SMALL))
    assert len(list((tmp_path / "reference" / "shards").iterdir())) >= 3
    root = tmp_path / "resumed"
    with pytest.raises(_Interrupt):
        run_pack(_options(pack_inputs, root, **SMALL), fault=_fail_at(stage, 1))
    assert not (root / folder.STATS_FILE).exists()
    (root / "shards").mkdir(exist_ok=True)
    (root / "shards" / "shard-00002.parquet.tmp").write_bytes(b"half a shard")  # as a kill mid-write leaves
    with pytest.raises(InputError, match="not empty"):
        run_pack(_options(pack_inputs, root, **SMALL))
    run_pack(_options(pack_inputs, root, resume=True, **SMALL))
    assert folder_bytes(root) == folder_bytes(tmp_path / "reference")


def test_resume_after_sigkill_mid_write(pack_inputs, tmp_path):
    root = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from loongforge.pack.job import PackOptions, run_pack
        def fault(stage, unit):
            if stage == "write" and unit == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        run_pack(PackOptions(inputs={tuple(pack_inputs)!r}, output=Path({str(root)!r}), preset={PRESET!r},
                             seq_len=512, packs_per_shard=1, progress=False), fault=fault)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (root / folder.MANIFEST_FILE).exists() and not (root / folder.STATS_FILE).exists()
    run_pack(_options(pack_inputs, root, resume=True, **SMALL))
    run_pack(_options(pack_inputs, tmp_path / "reference", **SMALL))
    assert folder_bytes(root) == folder_bytes(tmp_path / "reference")


def test_resume_refuses_a_folder_written_with_other_flags(pack_inputs, tmp_path):
    root = tmp_path / "out"
    run_pack(_options(pack_inputs, root))
    with pytest.raises(InputError, match="other inputs or flags"):
        run_pack(_options(pack_inputs, root, algorithm="ffd", resume=True))
    before = folder_bytes(root)
    run_pack(_options(pack_inputs, root, workers=2, resume=True))  # workers do not change the output
    assert folder_bytes(root) == before


def test_stats_json_keys(pack_inputs, tmp_path):
    root = tmp_path / "out"
    run_pack(_options(pack_inputs, root))
    stats = json.loads((root / folder.STATS_FILE).read_text())
    for key in ("samples_in", "samples_packed", "samples_rejected", "packs", "fill_ratio", "rejects_by_reason",
                "length_histogram", "seq_len", "algorithm", "preset"):
        assert key in stats
    assert sum(stats["length_histogram"]["counts"]) == stats["samples_packed"]
    assert stats["seq_len"] == SEQ_LEN and stats["preset"] == PRESET and stats["algorithm"] == "bfd"


def test_image_cap_below_a_sample_is_a_config_error(pack_inputs, tmp_path):
    from loongforge.config.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-images-per-pack 1 is below the 2 images"):
        run_pack(_options(pack_inputs, tmp_path / "out", max_images_per_pack=1))


def test_pretraining_documents_and_alpaca_pack(tmp_path):
    """Documents pack with every token a loss token and <|endoftext|> last; Alpaca records as
    chats; a document longer than --seq-len is cut into pieces of --seq-len tokens, each a sample
    of the pack, that put together give the whole document."""
    llamafactory = SHARED_DATA / "llamafactory"
    (tmp_path / "c4.jsonl").write_text("\n".join((llamafactory / "c4_demo.jsonl").read_text().splitlines()[:10]))
    (tmp_path / "wiki.txt").write_text("\n".join((llamafactory / "wiki_demo.txt").read_text().splitlines()[:2]))
    alpaca = json.loads((llamafactory / "alpaca_en_demo.json").read_text())[:10]
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    root = tmp_path / "out"
    stats = run_pack(_options([tmp_path / "c4.jsonl", tmp_path / "wiki.txt", tmp_path / "alpaca.json"], root)).stats
    assert folder.read_lines(root / folder.REJECTS_FILE) == []
    packed = PackedFolder(root)
    samples = [s for i in range(len(packed)) for s in packed.pack(i)]
    documents = [s for s in samples if Path(s.file).name == "c4.jsonl"]
    chats = [s for s in samples if Path(s.file).name == "alpaca.json"]
    assert len(documents) == 10 and len(chats) == 10
    assert stats["samples_packed"] == stats["samples_in"] == 22 and stats["documents_cut"] == 2
    assert all(s.is_answer.all() and s.input_ids[-1] == 151643 for s in documents)
    assert all(0 < s.is_answer.sum() < s.length for s in chats)
    pieces = {}
    for sample in samples:
        if Path(sample.file).name == "wiki.txt":
            pieces.setdefault(sample.line, {})[int(sample.sample_id.split("#")[1])] = sample
    tokenizer = load_tokenizer("qwen")
    for line, article in enumerate((tmp_path / "wiki.txt").read_text().splitlines(), start=1):
        ordered = [pieces[line][k] for k in sorted(pieces[line])]
        assert len(ordered) > 1 and all(p.length == SEQ_LEN for p in ordered[:-1])
        joined = np.concatenate([p.input_ids for p in ordered])
        assert tokenizer.decode(joined[:-1]) == article and joined[-1] == 151643
        assert all(p.is_answer.all() for p in ordered)
    with pytest.raises(ConfigError, match=r"data.record_kind='pretrain' is not one of auto \| conversation"):
        run_pack(_options([tmp_path / "c4.jsonl"], tmp_path / "other", record_kind="pretrain"))
