"""Reading conversation files: layouts, line numbers, and every reject reason from real bad files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.conversations import FileSamples, read_json_array
from loongforge.data.measure import MeasuredSample, SampleMeasurer
from loongforge.data.samples import REJECT_REASONS, ConversationSample, Reject
from tests.data.conftest import COCO_IMAGES, EXPECTED_REASONS, LLAMAFACTORY, good_record, require


def _measure_all(tokenizer, path, seq_len=2048):
    samples = FileSamples([str(path)])
    measurer = SampleMeasurer(tokenizer, DataConfig(seq_len=seq_len), ModelConfig(family="qwen2_5_vl"))
    results = []
    for i in range(len(samples)):
        sample = samples.get(i)
        results.append(measurer.measure(sample) if isinstance(sample, ConversationSample) else sample)
    return results


def test_every_reject_reason_with_file_and_line(tokenizer, bad_data):
    results = _measure_all(tokenizer, bad_data)
    rejects = {r.line: r for r in results if isinstance(r, Reject)}
    assert {line: r.reason for line, r in rejects.items()} == EXPECTED_REASONS
    # missing_embedding needs a store of embeddings: tests/train/test_vision_embeddings.py;
    # media_in_text_model a text-only model: tests/pack/test_job.py; video_in_image_model an image-only
    # model and beyond_vocabulary a tokenizer larger than the embedding: tests/data/test_internvl_data.py
    assert set(EXPECTED_REASONS.values()) == set(REJECT_REASONS) - {"missing_embedding", "media_in_text_model",
                                                               "video_in_image_model", "beyond_vocabulary"}
    assert all(r.file == str(bad_data) and r.detail for r in rejects.values())
    accepted = [r for r in results if isinstance(r, MeasuredSample)]
    assert [s.line for s in accepted] == [1, 11]
    assert accepted[1].sample_id == f"{bad_data}[10]"  # named by its ordinal: line 11 - 1
    assert "nowhere/missing.jpg" in rejects[6].detail and "robot" in rejects[3].detail


def test_json_list_keeps_lines_and_resyncs_after_a_broken_element():
    good = json.dumps(good_record(), indent=2).replace("\n", "\n  ")
    broken = '{\n    "messages": [ {"role": "user", "content": "x"} \n  }'
    text = "[\n  " + good + ",\n  " + broken + ",\n  " + good + "\n]\n"
    located = read_json_array(text)
    element_lines = [n for n, line in enumerate(text.splitlines(), start=1) if line.startswith("  {")]
    assert len(element_lines) == 3
    assert [(entry.line, entry.error is None) for entry in located] == list(zip(element_lines, [True, False, True]))
    assert located[2].record == good_record()


def test_single_line_json_list_reports_rest_unreadable():
    located = read_json_array('[{"a": 1}, {"b": ] ')
    assert located[0].record == {"a": 1}
    assert "rest of file unreadable" in located[1].error


def test_real_demo_files_parse_with_media_resolved():
    samples = FileSamples([str(require(LLAMAFACTORY / "mllm_demo.json")),
                           str(require(LLAMAFACTORY / "v1_multimodal_demo.jsonl"))])
    parsed = [samples.get(i) for i in range(len(samples))]
    assert all(isinstance(s, ConversationSample) for s in parsed) and len(parsed) == 30
    # v1 files name media relative to LLaMA-Factory's root ("data/mllm_demo_data/1.jpg").
    v1 = parsed[6]
    assert v1.line == 1 and v1.images == [str(LLAMAFACTORY / "mllm_demo_data" / "1.jpg")] * 2
    assert v1.turns[0].text == "<image>Who are they?" and v1.turns[2].text == "What are they doing?<image>"
    assert parsed[1].line == 26  # second element of the pretty-printed JSON list: "  {" on line 26


def test_parquet_with_image_bytes(tokenizer, tmp_path):
    jpg = sorted(require(COCO_IMAGES).glob("*.jpg"))[1].read_bytes()
    records = [
        {"conversations": [{"from": "human", "value": "<image>cap?"}, {"from": "gpt", "value": "A cat."}],
         "images": [{"bytes": jpg, "path": None}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}],
         "images": []},
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    results = _measure_all(tokenizer, tmp_path / "d.parquet")
    assert isinstance(results[0], MeasuredSample) and results[0].image_grids
    assert isinstance(results[1], Reject) and (results[1].reason, results[1].line) == ("empty_answer", 2)


def test_media_names_too_long_for_the_os_are_rejects_not_crashes(tokenizer, tmp_path):
    name = "x" * 300  # over the usual 255-byte file-name limit: Path.exists raises, not answers
    records = [good_record(f"{name}.jpg"),
               {"messages": [{"role": "user", "content": "<video>What?"}, {"role": "assistant", "content": "A."}],
                "videos": [f"{name}.mp4"]}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    results = _measure_all(tokenizer, path)
    assert [(r.line, r.reason) for r in results] == [(1, "corrupt_image"), (2, "missing_image")]
    assert "File name too long" in results[0].detail
