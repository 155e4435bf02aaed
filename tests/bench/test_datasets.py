"""The benchmark data sets: each reader, the file detection bench balance relies on, the data
root's errors, and sizing through pack's own measure path."""

import json

import pytest

from loongforge.bench.datasets import (
    ALPACA,
    ARENA_HARD,
    COCO_CAPTIONS,
    COCO_IMAGES,
    MATHVISTA,
    Chat,
    SampleSize,
    SampleSizer,
    alpaca_chats,
    arena_hard_chats,
    chat_reader,
    coco_chats,
    mathvista_chats,
    resolve_data_root,
)
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.template import Turn
from loongforge.data.vision import probe_image_size
from tests.shared_data import SHARED_DATA

PRESET = "qwen2.5vl-7b"


def test_data_root_comes_from_the_option_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LOONGFORGE_SHARED_DATA", raising=False)
    with pytest.raises(InputError, match="--data-root is not given"):
        resolve_data_root(None)
    monkeypatch.setenv("LOONGFORGE_SHARED_DATA", str(tmp_path))
    assert resolve_data_root(None) == tmp_path
    with pytest.raises(InputError, match=f"--data-root {tmp_path}: no coco2017"):
        resolve_data_root(None, [COCO_CAPTIONS])
    assert resolve_data_root(tmp_path / "x") == tmp_path / "x"


def test_each_reader_and_its_detection():
    expected = {COCO_CAPTIONS: (coco_chats, 25014, 1), MATHVISTA: (mathvista_chats, 1000, 1),
                ARENA_HARD: (arena_hard_chats, 750, 0), ALPACA: (alpaca_chats, 999, 0)}
    for path, (reader, count, images) in expected.items():
        assert chat_reader(SHARED_DATA / path) is reader
        chats = reader(SHARED_DATA / path)
        assert len(chats) == count
        assert all(len(c.image_sizes) == images and c.question.count("<image>") == images for c in chats)
        assert all(c.answer == c.answer.strip() or path != COCO_CAPTIONS for c in chats)
    assert chat_reader(SHARED_DATA / "llamafactory" / "mllm_demo.json") is None  # a conversation file


def test_sized_chat_equals_the_measured_sample(tmp_path):
    sizer = SampleSizer(PRESET)
    cfg = load_run_config(PRESET)
    measurer = SampleMeasurer(sizer.tokenizer, cfg.data, cfg.model)
    images = sorted((SHARED_DATA / COCO_IMAGES).glob("*.jpg"))[:3]
    if not images:
        pytest.skip("shared data not present")
    for path in images:
        chat = Chat("<image>What is shown?", "A scene.", [probe_image_size(str(path))])
        sample = ConversationSample(sample_id="x:1", file="x", line=1, images=[str(path)],
                                    turns=[Turn("user", chat.question), Turn("assistant", chat.answer)])
        measured = measurer.measure(sample)
        size = sizer.size(chat.to_sample("x:1"))
        assert size == SampleSize(measured.length, (measured.image_grids[0][1] * measured.image_grids[0][2],),
                                  measured.loss_tokens)
    text = sizer.size(Chat("Hello?", "Hi there.").to_sample("t"))
    assert text.patches == () and text.loss_tokens > 0
    # An aspect ratio the resize rules refuse is rejected as pack rejects it, not raised.
    assert isinstance(sizer.size(Chat("<image>?", "!", [(10000, 20)]).to_sample("r")), Reject)


def test_chat_reader_ignores_other_json(tmp_path):
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"a": 1}))
    assert chat_reader(other) is None
    lines = tmp_path / "y.jsonl"
    lines.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert chat_reader(lines) is None
