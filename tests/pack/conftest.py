"""Real input files for pack tests: shared demo data plus a file with one sample per reject reason."""

import json
import shutil
from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA

LOONGFORGE_VLM = SHARED_DATA / "loongforge" / "vlm"
LLAMAFACTORY = SHARED_DATA / "llamafactory"
COCO_IMAGES = SHARED_DATA / "coco2017" / "val2017"
SEQ_LEN = 2048
PRESET = "qwen2.5vl-tiny"


def require(path: Path) -> Path:
    assert path.exists(), f"shared data {path} not present (set LOONGFORGE_SHARED_DATA)"
    return path


def _chat(question, answer, images=None):
    record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    if images is not None:
        record["images"] = images
    return record


# Line of bad.jsonl -> the reject reason it must produce; the other lines are good samples.
BAD_LINES = {2: "malformed_json", 3: "bad_roles", 4: "bad_roles", 5: "empty_answer", 6: "missing_image",
             7: "corrupt_image", 8: "too_long", 9: "media_mismatch"}


@pytest.fixture()
def pack_inputs(tmp_path) -> list[str]:
    """bad.jsonl (every reject reason, with a real truncated JPEG), broken.json (a JSON list with
    one undecodable element) and the shared mixed text/image/video demo sets."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    jpgs = sorted(require(COCO_IMAGES).glob("*.jpg"))
    shutil.copy(jpgs[0], folder / "img.jpg")
    shutil.copy(jpgs[1], folder / "img2.jpg")
    data = jpgs[0].read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 3])
    lines = [
        json.dumps(_chat("<image>What is it?", "A photo.", ["img.jpg"])),  # 1 ok
        '{"messages": [{"role": "user", "content": "hi"},',  # 2 malformed_json
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}),  # 3
        json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}),  # 4
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}),  # 5
        json.dumps(_chat("<image>What is it?", "A photo.", ["nowhere/missing.jpg"])),  # 6 missing_image
        json.dumps(_chat("<image>What is it?", "A photo.", ["truncated.jpg"])),  # 7 corrupt_image
        json.dumps(_chat("word " * 3000, "ok")),  # 8 too_long
        json.dumps(_chat("<image><image>two?", "one", ["img.jpg"])),  # 9 media_mismatch
        json.dumps(_chat("<image>and <image>?", "Two photos.", ["img.jpg", "img2.jpg"])),  # 10 ok
        json.dumps(_chat("Plain text question?", "Plain text answer.")),  # 11 ok
    ]
    (folder / "bad.jsonl").write_text("\n".join(lines) + "\n")
    good = json.dumps(_chat("Hello?", "Hi there."))
    (folder / "broken.json").write_text(f"[\n  {good},\n  {{\"messages\": [oops]}},\n  {good}\n]\n")
    return [str(folder / "bad.jsonl"), str(folder / "broken.json"),
            str(require(LOONGFORGE_VLM / "mix.json")), str(require(LLAMAFACTORY / "mllm_demo.json"))]


def folder_bytes(root: Path) -> dict[str, bytes]:
    """Every file under a pack folder, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
