"""One `loongforge train` run on the record kinds of issue 32 as the files ship: LLaMA-Factory's C4
pretraining lines, its wiki articles (.txt, one per line, most longer than a row), its Alpaca demo
and the COCO val2017 captions (images present for 50 of 5,000): the loss falls and the captions
whose image is missing are counted rejects."""

from __future__ import annotations

import json
from collections import Counter

from tests.data.conftest import LLAMAFACTORY, SHARED_DATA, require
from tests.train.conftest import losses, run_train

FILES = [require(LLAMAFACTORY / "c4_demo.jsonl"), require(LLAMAFACTORY / "wiki_demo.txt"),
         require(LLAMAFACTORY / "alpaca_en_demo.json"), require(SHARED_DATA / "coco2017" / "captions_val2017.json")]


def test_pretraining_alpaca_and_caption_files_train_together(tmp_path):
    proc = run_train(tmp_path, "data.source=files", f"data.paths=[{','.join(map(str, FILES))}]",
                     f"data.cache_dir={tmp_path / 'cache'}", "data.caption_prompt=Describe the image.",
                     "training.train_steps=6", "schedule.warmup_steps=1")
    run_losses = losses(tmp_path)
    print(f"\nlosses: {run_losses}")
    assert len(run_losses) == 6 and run_losses[-1] < run_losses[0] - 0.15  # measured: 8.37 -> 8.05
    rejects = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    by_reason = Counter(r["reason"] for r in rejects)
    # Captions without their image, and Alpaca answers longer than the 384-token rows; never a
    # document: those longer than a row are cut into pieces, not rejected.
    assert {r["file"] for r in rejects if r["reason"] == "missing_image"} == {str(FILES[3])}
    assert {r["file"] for r in rejects if r["reason"] == "too_long"} <= {str(FILES[2])}
    assert by_reason["missing_image"] > 0 and set(by_reason) <= {"missing_image", "too_long"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rejects"] == dict(by_reason)
    assert f"{len(rejects)} samples rejected (" in proc.stdout + proc.stderr
