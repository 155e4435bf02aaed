"""Shared fixtures: the offline Qwen and Llama 3 tokenizers and the real demo data (read-only)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA

LLAMAFACTORY = SHARED_DATA / "llamafactory"
LOONGFORGE_VLM = SHARED_DATA / "loongforge" / "vlm"
COCO_IMAGES = SHARED_DATA / "coco2017" / "val2017"


def require(path: Path) -> Path:
    # The data ships beside the repository in CI and on every developer machine: a missing file is
    # a broken checkout, not a reason to skip.
    assert path.exists(), f"shared data {path} not present (set LOONGFORGE_SHARED_DATA)"
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from loongforge.config.schema import ModelConfig
    from loongforge.data.tokenizer import load_tokenizer
    from loongforge.models.registry import get_family

    # With the model's chat template, so tests can compare against apply_chat_template.
    return load_tokenizer("qwen", get_family("qwen2_5_vl").chat(ModelConfig(family="qwen2_5_vl")).jinja_template)


@pytest.fixture(scope="session")
def llama_tokenizer():
    """The offline Llama 3 tokenizer with the Llama chat template of the llama-tiny preset's model."""
    from loongforge.config.loader import load_run_config
    from loongforge.data.tokenizer import load_tokenizer
    from loongforge.models.registry import get_family

    model_cfg = load_run_config("llama-tiny").model
    return load_tokenizer("llama3", get_family(model_cfg.family).chat(model_cfg).jinja_template)


def write_conversations(path: Path, count: int) -> Path:
    """``count`` text conversations of varied lengths, one a line (sample ids ``<path>[<line - 1>]``)."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Question {i}: " + "why " * (i % 9)},
                                      {"role": "assistant", "content": "Because. " * (1 + i % 5)}]})
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_shared_image_records(folder: Path) -> tuple[Path, Path]:
    """The LLaMA-Factory demo's image conversations and one more showing ``1.jpg`` alone (the demo
    shows it only beside itself), image paths absolute: as a JSON array on one line (every record
    on line 1) and as JSON lines. A tower that cuts an image by how many its sample has
    (LLaVA-OneVision: anyres crops alone, one square beside another) gives ``1.jpg`` other features
    in the last record than in the first."""
    demo = require(LLAMAFACTORY / "mllm_demo.json")
    records = [{**record, "images": [str(demo.parent / image) for image in record["images"]]}
               for record in json.loads(demo.read_text())]
    records.append({"messages": [{"role": "user", "content": "<image>Who are they?"},
                                 {"role": "assistant", "content": "Two footballers celebrating."}],
                    "images": [str(demo.parent / "mllm_demo_data" / "1.jpg")]})
    array, lines = folder / "one_line.json", folder / "records.jsonl"
    array.write_text(json.dumps(records))
    lines.write_text("".join(json.dumps(record) + "\n" for record in records))
    return array, lines


def good_record(image="img.jpg"):
    return {"messages": [{"role": "user", "content": "<image>What is it?"},
                         {"role": "assistant", "content": "A photo."}], "images": [image]}


@pytest.fixture()
def bad_data(tmp_path):
    """A JSONL file with one sample per reject reason (and two good ones), plus its images."""
    jpg = sorted(require(COCO_IMAGES).glob("*.jpg"))[0]
    shutil.copy(jpg, tmp_path / "img.jpg")
    data = jpg.read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 3])
    lines = [
        json.dumps(good_record()),  # 1 ok
        '{"messages": [{"role": "user", "content": "hi"},',  # 2 malformed_json
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}),  # 3
        json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}),  # 4
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}),  # 5
        json.dumps(good_record("nowhere/missing.jpg")),  # 6 missing_image
        json.dumps(good_record("truncated.jpg")),  # 7 corrupt_image
        json.dumps({"messages": [{"role": "user", "content": "word " * 3000},
                                 {"role": "assistant", "content": "ok"}]}),  # 8 too_long
        json.dumps({"messages": [{"role": "user", "content": "<image><image>two?"},
                                 {"role": "assistant", "content": "one"}], "images": ["img.jpg"]}),  # 9
        "",  # blank lines are not records
        json.dumps({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "<image>x"},
                                      {"from": "gpt", "value": "y"}], "image": "img.jpg"}),  # 11 ok (LLaVA)
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


EXPECTED_REASONS = {2: "malformed_json", 3: "bad_roles", 4: "bad_roles", 5: "empty_answer", 6: "missing_image",
                    7: "corrupt_image", 8: "too_long", 9: "media_mismatch"}


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The offline Qwen3 tokenizer (Qwen2.5's plus <think> tokens) with the llm-tiny preset's
    (Qwen3 architecture) chat template."""
    from loongforge.config.loader import load_run_config
    from loongforge.data.tokenizer import load_tokenizer
    from loongforge.models.registry import get_family

    model_cfg = load_run_config("llm-tiny").model
    return load_tokenizer("qwen3", get_family(model_cfg.family).chat(model_cfg).jinja_template)
