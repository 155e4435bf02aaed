"""Preference pairs (data.preference): LLaMA-Factory's ranking records and prompt/chosen/rejected JSONL
read as pairs, each side tokenized as TRL's DPOTrainer tokenizes it, a pair one packing unit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trl.data_utils import _tokenize, common_prefix_length

from loongforge.config.loader import load_run_config
from loongforge.config.schema import DataConfig
from loongforge.data.collate import collate_row
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import MaterializedSample, SampleMeasurer
from loongforge.data.packing import LookaheadPacker
from loongforge.data.preference import completion_mask, measure_pair, pair_pack_item, row_pair_segments
from loongforge.data.record_kinds import PREFERENCE_READING
from loongforge.data.samples import PreferenceSample, Reject
from loongforge.data.template import turns_to_hf_messages
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.registry import get_family
from tests.data.conftest import LLAMAFACTORY, require

DPO_DEMO = LLAMAFACTORY / "dpo_en_demo.json"
PAIRS_CHECKED = 60  # of the demo's 300 pairs, tokenized by TRL too (about 0.1 s each)


@pytest.fixture(scope="module")
def llm():
    """The llm-tiny preset's model (Qwen3's thinking ChatML) and its tokenizer with the family's template."""
    model_cfg = load_run_config("llm-tiny").model
    tokenizer = load_tokenizer("qwen3", get_family(model_cfg.family).chat(model_cfg).jinja_template)
    return model_cfg, tokenizer


def _demo_pairs() -> list:
    samples = FileSamples([str(require(DPO_DEMO))], reading=PREFERENCE_READING)
    return [samples.get(index) for index in range(len(samples))]


def _trl_ids(tokenizer, pair: PreferenceSample, which: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as DPOTrainer's tokenize_fn builds them for a conversational example."""
    prompt = turns_to_hf_messages(pair.prompt)
    completion = [{"role": "assistant", "content": getattr(pair, which)}]
    prompt_ids = _tokenize(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
    full_ids = _tokenize(tokenizer, prompt + completion)["input_ids"]
    start = common_prefix_length(prompt_ids, full_ids)
    return full_ids[:start], full_ids[start:]


def test_demo_pairs_read_and_each_side_is_trls_prompt_and_completion(llm):
    """Every record of dpo_en_demo.json is a pair; each side's tokens equal TRL's prompt + completion ids
    and its loss tokens are exactly TRL's completion (answer, <|im_end|>, the trailing newline)."""
    model_cfg, tokenizer = llm
    pairs = _demo_pairs()
    assert len(pairs) == 300 and all(isinstance(pair, PreferenceSample) for pair in pairs)
    assert sum(len(pair.prompt) > 1 for pair in pairs) == 186  # multi-turn prompts among them
    measurer = SampleMeasurer(tokenizer, DataConfig(seq_len=100_000, tokenizer="qwen3"), model_cfg)
    completions = []
    for pair in pairs[:PAIRS_CHECKED]:
        measured = measure_pair(measurer, pair)
        for which, side in zip(("chosen", "rejected"), measured.sides):
            prompt_ids, completion_ids = _trl_ids(tokenizer, pair, which)
            assert side.input_ids.tolist() == prompt_ids + completion_ids
            assert side.is_answer.tolist() == [False] * len(prompt_ids) + [True] * len(completion_ids)
            completions.append(len(completion_ids))
    ending = tokenizer.decode(measured.chosen.input_ids[measured.chosen.is_answer][-2:])
    print(f"{2 * PAIRS_CHECKED} sides equal to TRL's tokenization; completion tokens p50 "
          f"{int(np.median(completions))}, max {max(completions)}; each ends {ending!r}")
    assert ending == "<|im_end|>\n"


def test_jsonl_prompt_chosen_rejected_and_bad_records_each_give_one_reject(tmp_path, llm):
    """The prompt/chosen/rejected layout (string and TRL's message lists) reads as the ShareGPT one does;
    each bad record is one Reject naming its problem."""
    records = [
        {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."},
        {"prompt": [{"role": "user", "content": "Say hi."}], "chosen": [{"role": "assistant", "content": "Hi!"}],
         "rejected": [{"role": "assistant", "content": "No."}]},
        {"conversations": [{"from": "human", "value": "Say hi."}], "chosen": {"from": "gpt", "value": "Hi!"},
         "rejected": {"from": "gpt", "value": "No."}},
        {"prompt": "Say hi.", "chosen": "Hi!"},  # no rejected
        {"prompt": "Say hi.", "chosen": "", "rejected": "No."},  # empty answer
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}],
         "chosen": "Hi!", "rejected": "No."},  # prompt ends with the assistant
        {"prompt": "Say hi.", "chosen": {"from": "human", "value": "Hi!"}, "rejected": "No."},  # not an answer
        {"prompt": "<image>What is it?", "chosen": "A cat.", "rejected": "A dog."},  # image without images
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    samples = FileSamples([str(path)], reading=PREFERENCE_READING)
    read = [samples.get(index) for index in range(len(samples))]
    good, bad = read[:3], read[3:]
    assert all(isinstance(pair, PreferenceSample) for pair in good)
    assert all((pair.prompt, pair.chosen, pair.rejected) == (good[0].prompt, "Hi!", "No.") for pair in good)
    assert [reject.reason for reject in bad] == ["malformed_json", "empty_answer", "bad_roles", "bad_roles",
                                                 "media_mismatch"]
    assert all(isinstance(reject, Reject) and reject.line == index + 4 for index, reject in enumerate(bad))
    print("\n".join(f"line {reject.line}: {reject.reason}: {reject.detail}" for reject in bad))
    model_cfg, tokenizer = llm
    too_short = SampleMeasurer(tokenizer, DataConfig(seq_len=24, tokenizer="qwen3"), model_cfg)
    rejected = measure_pair(too_short, good[0])  # each side fits 24 tokens, the pair does not
    assert rejected.reason == "too_long" and "in the pair" in rejected.detail


def test_a_pair_is_one_packing_unit_and_its_sides_two_segments(llm):
    """Packed, a pair's sides share a row as two segments (no attention between them), chosen first."""
    model_cfg, tokenizer = llm
    measurer = SampleMeasurer(tokenizer, DataConfig(seq_len=4096, tokenizer="qwen3"), model_cfg)
    measured = [measure_pair(measurer, pair) for pair in _demo_pairs()[:12]]
    measured = [pair for pair in measured if not isinstance(pair, Reject)]
    stream = iter(pair_pack_item(index, pair, sample_multiple=4) for index, pair in enumerate(measured))
    packer = LookaheadPacker(seq_len=4096, lookahead=4, sample_multiple=1)
    rows = []
    while row := packer.next_row(lambda: next(stream, None)):
        rows.append([item.payload for item in row])
    assert sorted(pair.sample_id for row in rows for pair in row) == sorted(pair.sample_id for pair in measured)
    first = rows[0]
    batch = collate_row([MaterializedSample(side, [], []) for side in row_pair_segments(first)], pad_to_multiple=8,
                        pad_token_id=model_cfg.tokens.pad_token_id,
                        position_ids=get_family(model_cfg.family).position_ids(model_cfg), sample_multiple=4)
    boundaries = batch["cu_seqlens"].tolist()
    assert len(boundaries) - 1 >= 2 * len(first)
    for index, pair in enumerate(first):
        for segment, side in zip((2 * index, 2 * index + 1), pair.sides):
            mask = batch["loss_mask"][0, boundaries[segment]:boundaries[segment + 1]]
            assert int(mask.sum()) == int(side.is_answer[1:].sum())  # every completion token is predicted
    print(f"{len(measured)} pairs in {len(rows)} rows of 4096; the first row's {len(first)} pairs are "
          f"{2 * len(first)} segments")


def test_completion_mask_starts_at_the_last_answer_and_runs_to_the_end():
    is_answer = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=bool)  # two assistant turns, then a separator
    assert completion_mask(is_answer).tolist() == [False] * 6 + [True] * 4
    assert not completion_mask(np.zeros(3, dtype=bool)).any()
