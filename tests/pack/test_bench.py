"""bench pack: its lengths are the ones `pack` measures, and its rows are consistent."""

import numpy as np

from loongforge.bench.pack import (
    BENCH_ALGORITHMS,
    Chat,
    ChatLengths,
    coco_chats,
    fill_rows,
    format_fill_table,
)
from loongforge.config.loader import load_run_config
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn
from loongforge.data.vision import probe_image_size
from tests.pack.conftest import COCO_IMAGES, require
from tests.shared_data import SHARED_DATA

PRESET = "qwen2.5vl-7b"


def test_lengths_from_image_sizes_equal_measured_lengths():
    measure = ChatLengths(PRESET)
    cfg = load_run_config(PRESET)
    measurer = SampleMeasurer(measure.tokenizer, cfg.data, cfg.model)
    for path in sorted(require(COCO_IMAGES).glob("*.jpg"))[:3]:
        chat = Chat("<image>What is shown?", "A scene.", [probe_image_size(str(path))])
        sample = ConversationSample(sample_id="x:1", file="x", line=1, images=[str(path)],
                                    turns=[Turn("user", chat.question), Turn("assistant", chat.answer)])
        assert measure([chat])[0] == measurer.measure(sample).length


def test_real_coco_set_and_fill_rows():
    chats = coco_chats(require(SHARED_DATA / "coco2017").parent)
    assert len(chats) == 25014 and all(len(c.image_sizes) == 1 for c in chats)
    lengths = np.array([9000, 5000, 4000, 3000, 1000, 200, 100] * 20)
    rows = fill_rows("coco", lengths, 8192)
    assert [r["algorithm"] for r in rows] == list(BENCH_ALGORITHMS)
    assert all(r["too_long"] == 20 and r["samples"] == 120 and r["fill"] <= r["bound"] + 1e-12 for r in rows)
    assert "| coco | 8192 | 120 (20) |" in format_fill_table(rows)
