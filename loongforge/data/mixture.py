"""Weighted data mixtures: ``data.paths`` entries written ``path@weight``.

``data.paths=[web.jsonl@3, code.jsonl@1]`` trains three ``web`` samples for each ``code`` one,
whatever the files' sizes. The mix is a fixed sequence of *draws*: draw ``d`` names a source
(a data.paths entry) and that source's next sample. Shares are exact over any window, not merely
in expectation: the weights are made whole numbers ``w_s`` (3 and 1; 0.7 and 0.3 give 7 and 3)
whose sum ``P`` is the pattern's period, and within each period of ``P`` draws source ``s`` is
drawn exactly ``w_s`` times, spread evenly (smooth weighted round-robin: the source furthest
behind its share goes next, ties to the first entry). So after any ``n`` draws each source has
``n * w_s / P`` of them, give or take one.

Each source has its own epochs: its ``k``-th draw is sample ``k % size`` of its epoch
``k // size``, visited in a permutation drawn from (data.seed, source, epoch) when data.shuffle.
A source that runs out starts its next epoch; a small source weighted high is seen many times.
Draw ``d`` is a closed form (``d // P`` periods, then the pattern), so any stretch of the
sequence is computed directly, which is what exact resume and sharded reading need.

Entries without ``@`` keep today's reading (one epoch visits every sample once); once one entry has
a weight every entry needs one. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache, reduce
from typing import Callable, Optional

import numpy as np

from loongforge.config.errors import InputError

# The draw pattern is held in memory, one entry per draw of a period; weights such as 0.3333 and
# 0.6667 need 10,000. More digits than that say nothing about a training mix.
MAX_PERIOD = 100_000
_WEIGHT_REMEDY = "write each entry as path@weight with a positive number, e.g. data.paths=[a.jsonl@3,b.jsonl@1]"


@dataclass(frozen=True)
class PathEntry:
    path: str
    weight: Optional[Fraction]  # None: the entry gives no weight


def parse_entry(entry: str) -> PathEntry:
    """``path@weight`` -> (path, weight); an entry whose text after its last ``@`` is not a number
    is a path as written (a file may have ``@`` in its name)."""
    entry = str(entry)
    path, at, text = entry.rpartition("@")
    if not at or not path:
        return PathEntry(entry, None)
    try:
        weight = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return PathEntry(entry, None)
    if weight <= 0:
        raise InputError(f"data.paths entry {entry!r} has weight {text}; weights must be above 0 "
                         f"({_WEIGHT_REMEDY}), or drop the entry")
    return PathEntry(path, weight)


def entry_path(entry: str) -> str:
    """The path part of a data.paths entry (what every reader opens)."""
    return parse_entry(entry).path


def entry_weights(paths: list) -> Optional[list[int]]:
    """The entries' weights as whole numbers with no common factor, or None when no entry has a
    weight (the run reads as it always did). One entry with a weight and another without is an
    InputError naming the latter."""
    entries = [parse_entry(entry) for entry in paths]
    if all(e.weight is None for e in entries):
        return None
    missing = next((str(raw) for raw, e in zip(paths, entries) if e.weight is None), None)
    if missing is not None:
        raise InputError(f"data.paths entry {missing!r} has no weight while others have one; give every entry "
                         f"one ({_WEIGHT_REMEDY}), or none")
    weights = [e.weight for e in entries]
    denominator = reduce(math.lcm, (w.denominator for w in weights))
    whole = [int(w * denominator) for w in weights]
    common = reduce(math.gcd, whole)
    whole = [w // common for w in whole]
    if sum(whole) > MAX_PERIOD:
        raise InputError(f"data.paths weights {[str(raw) for raw in paths]} repeat only every {sum(whole):,} draws "
                         f"(at most {MAX_PERIOD:,}); give weights with fewer digits, e.g. whole numbers")
    return whole


def draw_pattern(weights: list[int]) -> np.ndarray:
    """Source of each draw of one period (``sum(weights)`` draws): the source furthest behind its
    share goes next, ties to the first. Weights 3, 1 give [0, 0, 1, 0]... spread evenly."""
    period = sum(weights)
    taken = [0] * len(weights)
    pattern = np.empty(period, dtype=np.int64)
    for draw in range(period):
        s = max(range(len(weights)), key=lambda s: ((draw + 1) * weights[s] - taken[s] * period, -s))
        pattern[draw] = s
        taken[s] += 1
    return pattern


class Mixture:
    """The draw sequence over sources of ``sizes`` samples with whole-number ``weights``; sample
    indices are global (source ``s`` holds ``starts[s] .. starts[s] + sizes[s] - 1``)."""

    def __init__(self, weights: list[int], sizes: list[int], starts: list[int], *, seed: int, shuffle: bool):
        self.weights = np.asarray(weights, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.seed, self.shuffle = seed, shuffle
        self.pattern = draw_pattern(list(weights))
        self.period = len(self.pattern)
        # before[r, s]: draws of source s among the pattern's first r (r = 0 .. period).
        one_hot = np.zeros((self.period, len(weights)), dtype=np.int64)
        one_hot[np.arange(self.period), self.pattern] = 1
        self.before = np.vstack([np.zeros((1, len(weights)), dtype=np.int64), np.cumsum(one_hot, axis=0)])

    def taken(self, draw: int) -> np.ndarray:
        """How many of the first ``draw`` draws went to each source."""
        periods, rest = divmod(int(draw), self.period)
        return periods * self.weights + self.before[rest]

    def epochs(self, draw: int) -> list[float]:
        """Each source's epochs after ``draw`` draws (1.5: its second pass half done)."""
        return [float(t) / float(n) for t, n in zip(self.taken(draw), self.sizes)]

    def sources(self, draws: np.ndarray) -> np.ndarray:
        return self.pattern[np.asarray(draws, dtype=np.int64) % self.period]

    def indices(self, first: int, count: int) -> np.ndarray:
        """Sample index of draws ``first .. first + count - 1``, shape [count]."""
        draws = np.arange(first, first + count, dtype=np.int64)
        periods, rest = np.divmod(draws, self.period)
        source = self.pattern[rest]
        kth = periods * self.weights[source] + self.before[rest, source]  # the source's k-th draw
        epoch, position = np.divmod(kth, self.sizes[source])
        out = np.empty(count, dtype=np.int64)
        for s in range(len(self.sizes)):
            drawn = np.flatnonzero(source == s)  # [draws of s]; its epochs never decrease along them
            runs = np.flatnonzero(np.diff(epoch[drawn])) + 1  # where each of its next epochs begins
            for run in np.split(drawn, runs):  # one epoch of s at a time: a small source has many
                if len(run):
                    out[run] = self.starts[s] + self.order(s, int(epoch[run[0]]))[position[run]]
        return out

    def order(self, source: int, epoch: int) -> np.ndarray:
        """Source ``source``'s samples (indices within it) in the order its ``epoch`` visits them."""
        return _source_order(int(self.sizes[source]), self.seed, source, epoch, self.shuffle)


@lru_cache(maxsize=16)  # a few epochs of each source at once; a large source's order is 8 bytes a sample
def _source_order(size: int, seed: int, source: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Source ``source``'s visiting order in its ``epoch``: seeded by (seed, source, epoch)."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, source, epoch]).permutation(size)


def check_none_empty(paths: list, sizes: list[int]) -> None:
    """A weighted entry with nothing to read would silently lose its share: one line naming it.
    ``sizes``: per entry, its samples (or data sources) found."""
    empty = next((entry for entry, size in zip(paths, sizes) if not size), None)
    if empty is not None:
        raise InputError(f"data.paths entry {empty!r} has a weight but holds no samples; drop it or give it data")


def all_rejected_error(name: str, reasons: Counter, what: str = "samples",
                       entry: str = "data.paths entry") -> InputError:
    """The one line for a weighted entry none of whose samples can be trained: it would silently
    give its share to the others. ``reasons``: reject reason -> count; ``entry``: what the user calls the
    entry (a ``data.paths`` entry in training, an input of ``loongforge pack``)."""
    by_reason = ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items()))
    return InputError(f"{entry} {name!r}: all {sum(reasons.values())} {what} were rejected ({by_reason}); "
                      "fix them or drop the entry (its weight would go to the other entries)")


def check_entries_usable(mixture: Mixture, names: list[str], reject_reason: Callable[[int], Optional[str]],
                         entry: str = "data.paths entry") -> None:
    """Stop before training or packing on a weighted entry whose every sample is rejected (its share
    would silently go to the others). ``reject_reason(index)``: why global sample ``index`` is
    rejected, None when it is usable. Each entry is looked at in its first epoch's order until a
    sample is usable: one look for a usable entry, all of its samples for a rejected one."""
    for source, name in enumerate(names):
        reasons: Counter = Counter()
        for index in mixture.order(source, 0):
            reason = reject_reason(int(mixture.starts[source] + index))
            if reason is None:
                break
            reasons[reason] += 1
        else:
            raise all_rejected_error(name, reasons, entry=entry)


def build_mixture(paths: list, spans: list[range], *, seed: int, shuffle: bool) -> Optional[Mixture]:
    """The mixture of ``paths`` whose entries hold the samples ``spans`` (one range of global
    sample indices per entry), or None when no entry has a weight."""
    weights = entry_weights(paths)
    if weights is None:
        return None
    check_none_empty(paths, [len(span) for span in spans])
    return Mixture(weights, [len(span) for span in spans], [span.start for span in spans], seed=seed,
                   shuffle=shuffle)


def check_same_weights(saved: Optional[list[int]], here: Optional[list[int]]) -> None:
    """A resume reads the draws a checkpoint's position counts in only with the weights it was
    saved with (None: none); else one line."""
    if saved != here:
        raise InputError(f"the checkpoint's data position was saved with data.paths weights {saved or 'none'}, "
                         f"this run has {here or 'none'}: resume with the data.paths it was saved with")


def source_names(paths: list) -> list[str]:
    """What metrics call each data.paths entry: its path (with its position when a path repeats)."""
    names = [entry_path(entry) for entry in paths]
    return [f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


class SourceCounts:
    """Samples and tokens trained from each source (data.paths entry), from the run's start:
    counted as rows leave the packer, so samples it still holds are not counted yet. With
    ``rejected`` (a streamed mixture, whose draws have no closed form) also the records rejected,
    so that samples + rejected are the records drawn (``epochs``)."""

    def __init__(self, names: list[str], *, rejected: bool = False):
        self.names = list(names)
        self.samples = [0] * len(names)
        self.tokens = [0] * len(names)
        self.rejected = [0] * len(names) if rejected else None

    def add(self, source: int, key: tuple, tokens: int) -> None:
        """One packed item: ``key`` its stream position, (epoch, position) or (epoch, position,
        piece) for a piece of a document cut to the row length, which counts once, at piece 0."""
        self.tokens[source] += int(tokens)
        if len(key) == 2 or key[2] == 0:
            self.samples[source] += 1

    def reject(self, source: int) -> None:
        self.rejected[source] += 1

    def drawn(self, counts: dict) -> list[int]:
        """Records drawn from each source: trained or rejected (``counts``: a ``state``, or a sum)."""
        return [n + r for n, r in zip(counts["samples"], counts["rejected"])]

    def state(self) -> dict:
        rejected = {"rejected": list(self.rejected)} if self.rejected is not None else {}
        return {"samples": list(self.samples), "tokens": list(self.tokens), **rejected}

    def load(self, state: dict) -> None:
        self.samples = [int(n) for n in state["samples"]]
        self.tokens = [int(n) for n in state["tokens"]]
        if self.rejected is not None:  # a checkpoint from before it was counted: from 0
            self.rejected = [int(n) for n in state.get("rejected", [0] * len(self.names))]


def summed_counts(states: list[dict]) -> dict:
    """One ``SourceCounts.state`` from every data-parallel shard's."""
    return {key: [sum(values) for values in zip(*(state.get(key, [0] * len(states[0]["samples"]))
                                                  for state in states))]
            for key in states[0]}


def redealt_counts(states: list[dict], shard_index: int) -> dict:
    """New shard ``shard_index``'s counts after a re-deal of the saved shard ``states``: shard 0
    carries on all of theirs, the others start at 0, so the sum over shards goes on unchanged."""
    counts = summed_counts(states)
    if shard_index:
        return {key: [0] * len(values) for key, values in counts.items()}
    return counts


def counts_report(names: list[str], counts: dict, epochs: Optional[list[float]] = None) -> dict:
    """{source: {"samples", "tokens"[, "epochs"]}}: what metrics.jsonl and summary.json show."""
    report = {}
    for s, name in enumerate(names):
        report[name] = {"samples": counts["samples"][s], "tokens": counts["tokens"][s]}
        if epochs is not None:  # None for a streamed source whose size is not known yet
            report[name]["epochs"] = round(epochs[s], 4) if epochs[s] is not None else None
    return report
