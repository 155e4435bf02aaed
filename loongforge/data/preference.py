"""Preference pairs measured as two sides of one unit, and that unit's place in a packed row.

Records read as pairs (``record_kinds.PREFERENCE_READING``, what ``preference.loss`` selects;
``conversations.preference_fields``):

- LLaMA-Factory's ShareGPT ranking layout: ``conversations`` (or ``messages``) for the prompt, ending
  with a user turn, ``chosen`` and ``rejected`` one assistant message each (``{"from": "gpt", "value":
  ...}`` or ``{"role": "assistant", "content": ...}``), optional ``system``, ``images`` / ``videos``
  (``<image>`` where each stands);
- the common JSONL layout: ``prompt`` (a string: one user turn; or a list of messages, TRL's
  conversational format), ``chosen`` and ``rejected`` (strings, or a list of one assistant message).

Each side is the record's conversation with its answer as the last assistant turn, rendered in the
family's training chat format (default system prompt, image blocks) and tokenized once, exactly as
SFT measures a conversation (``measure.SampleMeasurer``). Its loss tokens (``is_answer``) are every
token after the generation prompt, as TRL builds the completion: the answer, its end-of-turn token
and what the template writes after it (ChatML's trailing newline). Summed under the model they are
the side's log-prob (``train.preference_loss``).

A pair is one unit: one ``PackItem`` of both sides' tokens whose rows put the sides in two segments
(each side attends only to its own prompt copy), never split across rows, ranks or steps. A bad
record, or a side SFT's measuring rejects (too long, a missing image), rejects the pair: one
``Reject``, counted and logged once as any other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Union

import numpy as np

from loongforge.data.measure import MeasuredSample, SampleMeasurer
from loongforge.data.packing import LookaheadPacker, PackItem, padded_length
from loongforge.data.samples import PreferenceSample, Reject

PAIR_SIDES = ("chosen", "rejected")


@dataclass
class MeasuredPair:
    """Both sides measured; each side's ``is_answer`` marks its completion (``completion_mask``)."""

    chosen: MeasuredSample
    rejected: MeasuredSample

    @property
    def sample_id(self) -> str:
        return self.chosen.sample_id

    @property
    def sides(self) -> tuple[MeasuredSample, MeasuredSample]:
        return self.chosen, self.rejected

    @property
    def length(self) -> int:
        return self.chosen.length + self.rejected.length

    def footprint(self, sample_multiple: int = 1) -> int:
        """Tokens the pair takes in a row whose samples are padded to ``sample_multiple`` (each side a
        segment of its own, padded on its own)."""
        return sum(padded_length(side.length, sample_multiple) for side in self.sides)


def completion_mask(is_answer: np.ndarray) -> np.ndarray:
    """bool [L]: every token from the first of the last answer run on; ``is_answer`` [L] marks each
    assistant turn's answer and end-of-turn token (``template.render_chat``), so its last run is the
    final answer, and what follows it (the template's separator after the last turn) is the rest of
    the text TRL's completion holds."""
    answer_at = np.flatnonzero(is_answer)
    if not len(answer_at):
        return np.zeros_like(is_answer)
    gaps = np.flatnonzero(np.diff(answer_at) > 1)
    start = answer_at[gaps[-1] + 1] if len(gaps) else answer_at[0]
    return np.arange(len(is_answer)) >= start


def measure_pair(measurer: SampleMeasurer, pair: PreferenceSample) -> Union[MeasuredPair, Reject]:
    """Both sides measured as SFT measures a conversation, each marked on its completion; the first
    side's Reject rejects the pair (a side too long for data.seq_len alone, or the pair too long for
    one row: the sides are never split)."""
    sides = []
    for which in ("chosen", "rejected"):
        measured = measurer.measure(pair.side(which))
        if isinstance(measured, Reject):
            return Reject.of(pair, measured.reason, f"{which}: {measured.detail}")
        sides.append(replace(measured, is_answer=completion_mask(measured.is_answer)))
    measured_pair = MeasuredPair(*sides)
    seq_len = measurer.data_cfg.seq_len
    if measured_pair.length > seq_len:
        return Reject.of(pair, "too_long", f"{measured_pair.length} tokens in the pair (chosen {sides[0].length}, "
                                           f"rejected {sides[1].length}) > data.seq_len={seq_len}")
    return measured_pair


class PairMeasurer:
    """``SampleMeasurer``'s place in a row stream of pairs: ``measure`` gives a MeasuredPair or a Reject."""

    def __init__(self, measurer: SampleMeasurer):
        self.measurer = measurer
        self.data_cfg = measurer.data_cfg

    def measure(self, pair: PreferenceSample) -> Union[MeasuredPair, Reject]:
        return measure_pair(self.measurer, pair)


def pair_pack_item(key: Hashable, pair: MeasuredPair, sample_multiple: int = 1) -> PackItem[MeasuredPair]:
    """The pair as one packing unit: its two padded sides' tokens, never split."""
    return PackItem(key=key, length=pair.footprint(sample_multiple), payload=pair)


def pack_pairs(items: list[PackItem[MeasuredPair]], seq_len: int) -> list[list[MeasuredPair]]:
    """A step's pairs packed into rows of ``seq_len`` tokens, first fit in their order (the packer's, with
    every pair in view): every pair of the step in exactly one row, whole."""
    packer: LookaheadPacker[MeasuredPair] = LookaheadPacker(seq_len, lookahead=max(len(items), 1))
    stream = iter(items)
    rows = []
    while row := packer.next_row(lambda: next(stream, None)):
        rows.append([item.payload for item in row])
    return rows


def row_pair_segments(pairs: list[MeasuredPair]) -> list[MeasuredSample]:
    """The row's samples in collate order, chosen then rejected per pair: segment 2i is pair i's chosen
    side and 2i + 1 its rejected side (``collate.collate_row`` makes each its own segment)."""
    return [side for pair in pairs for side in pair.sides]
