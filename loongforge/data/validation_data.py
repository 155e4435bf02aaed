"""``data.valid_fraction``: a fixed share of the training samples held out as a validation set
(the named sets of ``data.valid_paths`` are read as files are: ``config.data_sets``).

Held-out samples are chosen by position in the indexed source (its files in order, then records in
file order) and ``data.seed`` alone: the first ``round(fraction * N)`` positions of a permutation
drawn from (seed, "held-out"). The same files and seed therefore hold out the same samples in every
run, on every rank and after every resume, and the two views partition the source: each sample is
trained or validated on, never both, never neither.
"""

from __future__ import annotations

import zlib

import numpy as np

# Mixed into the permutation's seed so the held-out draw is not the epoch-0 shuffle of data.seed.
_HELD_OUT_STREAM = zlib.crc32(b"loongforge-held-out")


def held_out_count(total: int, fraction: float) -> int:
    """Samples held out of ``total``: at least one, and at least one left to train on."""
    if total < 2:
        raise ValueError(f"data.valid_fraction={fraction} needs at least 2 samples to split; the data has {total}")
    return min(total - 1, max(1, round(fraction * total)))


def held_out_positions(total: int, fraction: float, seed: int) -> np.ndarray:
    """Sorted positions (of ``total``) that form the validation set."""
    order = np.random.default_rng([seed, _HELD_OUT_STREAM]).permutation(total)
    return np.sort(order[:held_out_count(total, fraction)])


class SampleSubset:
    """The samples of ``source`` at ``positions`` (sorted), indexable like the source itself."""

    def __init__(self, source, positions: np.ndarray):
        self.source = source
        self.positions = positions  # [n] int64, increasing

    def __len__(self) -> int:
        return len(self.positions)

    def get(self, index: int):
        return self.source.get(int(self.positions[index]))

    def entry_spans(self) -> list[range]:
        """Per data.paths entry, the indices (here) of its samples that this subset keeps: a
        weighted mixture over the training samples draws from each entry's remaining ones."""
        return [range(int(np.searchsorted(self.positions, span.start)), int(np.searchsorted(self.positions, span.stop)))
                for span in self.source.entry_spans()]

    def fingerprints(self):
        """The whole source's (a checkpoint records the files, not the split)."""
        fingerprints = getattr(self.source, "fingerprints", None)
        return fingerprints() if fingerprints is not None else None


def split_held_out(source, fraction: float, seed: int) -> tuple[SampleSubset, SampleSubset]:
    """(training view, held-out view) of an indexed ``source``."""
    held = held_out_positions(len(source), fraction, seed)
    kept = np.setdiff1d(np.arange(len(source)), held, assume_unique=True)
    return SampleSubset(source, kept), SampleSubset(source, held)

