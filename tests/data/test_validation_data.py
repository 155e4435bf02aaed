"""Validation data (issue 32): named sets from data.valid_paths, and data.valid_fraction's held-out
share, which partitions the training samples (each trained or validated on, never both, never
neither), fixed for the files and seed."""

from __future__ import annotations

import numpy as np
import pytest

from loongforge.config.data_sets import named_sets
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.pipeline import DataPipeline
from loongforge.data.validation_data import held_out_count, held_out_positions, split_held_out

MODEL = ModelConfig(family="qwen2_5_vl")


def test_sets_are_named_by_their_entries_or_files():
    assert named_sets(["dev=/d/a.jsonl", "/d/test.json", "dev=/d/b.jsonl", "/d/x=1.jsonl"]) == {
        "dev": ["/d/a.jsonl", "/d/b.jsonl"], "test": ["/d/test.json"], "x=1": ["/d/x=1.jsonl"]}


def test_the_held_out_share_is_fixed_by_the_seed():
    held = held_out_positions(1000, 0.05, seed=7)
    assert len(held) == 50 and np.array_equal(held, np.unique(held))
    assert np.array_equal(held, held_out_positions(1000, 0.05, seed=7))
    assert not np.array_equal(held, held_out_positions(1000, 0.05, seed=8))
    # Not the epoch-0 shuffle of the same seed: held-out samples are spread over the data.
    assert held.min() < 100 and held.max() > 900
    assert held_out_count(3, 0.01) == 1 and held_out_count(3, 0.99) == 2


def _epoch_sample_ids(tokenizer, *, held_out: bool, samples: int) -> list[str]:
    data_cfg = DataConfig(source="synthetic", synthetic_num_samples=samples, seq_len=512, num_workers=0, seed=5,
                          valid_fraction=0.25)
    pipeline = DataPipeline(data_cfg, MODEL, global_batch_size=2, dp_rank=0, dp_size=1, pad_to_multiple=16,
                            tokenizer=tokenizer, held_out=held_out)
    ids: list[str] = []
    while (pipeline.last_row_epoch or 0) < 2:  # two whole epochs (the packer's lookahead mixes their ends)
        ids += [sample_id for mb in pipeline.next_step() for sample_id in mb["sample_ids"]]
    return ids


def test_training_and_held_out_samples_partition_the_data(tokenizer):
    trained = _epoch_sample_ids(tokenizer, held_out=False, samples=40)
    validated = _epoch_sample_ids(tokenizer, held_out=True, samples=40)
    print(f"trained {len(set(trained))} ({len(trained)} drawn), held out {len(set(validated))} "
          f"({len(validated)} drawn) of 40")
    assert len(set(validated)) == 10 and len(set(trained)) == 30
    assert not set(trained) & set(validated)
    assert set(trained) | set(validated) == {f"synthetic:{i}" for i in range(40)}


@pytest.mark.parametrize("overrides, message", [
    (("data.valid_fraction=1.0",), "data.valid_fraction=1.0 must be in [0, 1)"),
    (("training.eval_interval=5",), "training.eval_interval evaluates validation sets, and there are none"),
    (("data.valid_fraction=0.1", "data.source=packed", "data.packed=/x"), "data.valid_fraction holds samples out"),
    (("data.valid_fraction=0.1", "data.valid_paths=[heldout=/x.jsonl]"), 'names a set "heldout"'),
    (("data.valid_paths=[=/x.jsonl]",), 'an entry "=path" has no set name'),
    (("data.valid_paths=[/x.jsonl]", "training.eval_iters=0"), "training.eval_iters=0 must be at least 1"),
])
def test_bad_validation_settings_name_the_key(overrides, message):
    from tests.config.test_validate import errors_for

    errors = errors_for(*overrides)
    assert len(errors) == 1 and message in errors[0], errors


class _TwoEntries:
    """A source of 10 samples from two data.paths entries (4 and 6), as ArrowSamples reports them."""

    def __len__(self) -> int:
        return 10

    def entry_spans(self) -> list[range]:
        return [range(0, 4), range(4, 10)]


def test_a_mixture_draws_each_entry_from_its_training_samples():
    training, held_out = split_held_out(_TwoEntries(), 0.3, seed=3)
    kept = training.positions.tolist()
    spans = training.entry_spans()
    print(f"held out {held_out.positions.tolist()}, spans {spans}")
    assert [kept[i] for i in spans[0]] == [p for p in kept if p < 4]
    assert [kept[i] for i in spans[1]] == [p for p in kept if p >= 4]
    assert spans[0].stop == spans[1].start and spans[1].stop == len(training) == 7
