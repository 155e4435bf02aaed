"""LLaVA-OneVision-1.5's own recipe data, as its releases come (parquet rows, images as bytes), read as they are:
- mid-training captions (``LLaVA-OneVision-1.5-Mid-Training-85M``): ``id``, ``image`` ({bytes, path}),
  ``caption`` -> a caption sample (the image as the user turn, the caption as the answer, as the recipe's own
  conversion writes it: user ``<image>``, assistant the caption);
- instruct data (``LLaVA-OneVision-1.5-Instruct-Data``, LLaVA-NeXT's layout): ``id``, ``conversations``
  ([{from: human|gpt, value}]), ``image`` ({bytes, path} or null for text-only rows) -> a conversation.
Both through the family's chat template (Qwen2-VL's ChatML, its default system turn) at the tiny preset: each
photo's pads are its merged patches, the answers are the loss tokens."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from loongforge.config.loader import load_run_config
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import MeasuredSample, SampleMeasurer
from loongforge.data.tokenizer import load_tokenizer
from tests.data.conftest import COCO_IMAGES, require

PRESET = "llava-onevision1.5-tiny-small-vocab"


def _jpeg(path) -> dict:
    buffer = io.BytesIO()
    Image.open(path).convert("RGB").save(buffer, format="JPEG")
    return {"bytes": buffer.getvalue(), "path": None}


def _photos(count: int) -> list:
    return sorted(require(COCO_IMAGES).glob("*.jpg"))[:count]


def test_the_recipes_caption_and_instruct_parquet_rows_train_as_they_come(tmp_path):
    cfg = load_run_config(PRESET, overrides=["data.max_pixels=12544"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    measure = SampleMeasurer(tokenizer, cfg.data, cfg.model)
    photos = _photos(3)
    captions = ["A cat sleeps on a red sofa next to a window.", "Two people ride bicycles along a beach path.",
                "A plate of pasta with tomatoes and basil on a wooden table."]
    mid = tmp_path / "mid_training.parquet"
    pq.write_table(pa.table({"id": [f"mid/{i}.jpg" for i in range(3)], "image": [_jpeg(p) for p in photos],
                             "caption": captions}), mid)
    turns = [[{"from": "human", "value": "<image>\nWhat is on the table?"}, {"from": "gpt", "value": "Pasta."}],
             [{"from": "human", "value": "Name a prime number."}, {"from": "gpt", "value": "Seven."}]]
    instruct = tmp_path / "instruct.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "conversations": turns, "image": [_jpeg(photos[2]), None]}), instruct)

    samples = FileSamples([str(mid), str(instruct)])
    measured = [measure.measure(samples.get(i)) for i in range(len(samples))]
    assert all(isinstance(sample, MeasuredSample) for sample in measured), measured
    answers = [tokenizer.decode(sample.input_ids[sample.is_answer]) for sample in measured]
    image_pad = cfg.model.tokens.image_token_id
    pads = [int((sample.input_ids == image_pad).sum()) for sample in measured]
    expected_pads = [int(np.prod(grid)) // 4 for sample in measured for grid in sample.image_grids]
    print(f"\n{len(measured)} samples: answers {answers}; image pads {pads}")
    assert [answer.removesuffix("<|im_end|>").strip() for answer in answers] == [*captions, "Pasta.", "Seven."]
    assert pads == [*expected_pads, 0] and all(pads[:4])
    assert tokenizer.decode(measured[0].input_ids).startswith("<|im_start|>system\nYou are a helpful assistant.")
