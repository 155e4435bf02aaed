"""Offline bin packing of samples (token lengths) into packs of at most ``seq_len`` tokens.

Pure Python + numpy: no torch, no torch.distributed. Everything is deterministic (stable sorts,
ties broken by arrival order) and fast enough for millions of samples:

- ``bfd`` (best-fit decreasing, the default): longest sample first, into the open pack whose free
  space is the smallest that still fits. Free space is an integer in [1, seq_len], so packs are
  kept in one stack per free-space value plus a sorted list of the values present; finding the
  best fit is one ``bisect``.
- ``ffd`` (first-fit decreasing): longest first, into the oldest pack that fits; a max-segment-tree
  over packs finds it in O(log packs). Unopened packs count as empty, so the first of them is
  "the oldest pack that fits" when no open pack does.
- ``balanced``: evens out the attention cost (sum of L^2) of packs at BFD's fill. Long samples
  (from a fraction of seq_len) go worst-fit, each to the pack with the most room among the
  ceil(tokens / seq_len) packs opened up front, so they do not cluster; shorter ones best-fit
  into the gaps. The plan is kept if it needs at most ~0.1% more packs than that lower bound
  (else BFD's packs are used). Then rounds pair the costliest pack with the cheapest and
  re-split their samples, keeping a split only when it lowers the pair's maximum.
- Baselines for ``bench pack``: ``first_fit`` (arrival order, no sorting) and ``knapsack``
  (fill one pack at a time with the largest remaining sample that fits).

Constraints: ``max_images`` caps images+videos per pack (bfd, ffd, balanced); ``kinds`` with
``group_by_media`` plans text-only, image and video samples separately, so no pack mixes them.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import numpy as np

ALGORITHMS = ("bfd", "ffd", "balanced")
BASELINES = ("first_fit", "knapsack")
MEDIA_KINDS = ("text", "image", "video")  # kind codes 0, 1, 2

# A sample that does not fit the best pack because of the image cap looks at this many other
# candidate packs before opening a new one: bounded work per sample on image-heavy data.
_IMAGE_PROBES = 64
# ``balanced``: a sample is "long", and spread over packs, from this fraction of seq_len (the best
# of 0.05 / 0.125 / 0.25 on the real sets of docs/benchmarks/pack.md). The spread plan is kept if it
# needs at most 0.1% (+1) packs more than the lower bound, i.e. fill within ~0.1% of the best.
_SPREAD_FROM = 0.05
_SPREAD_SLACK = 0.001


def plan_packs(lengths: Sequence[int], seq_len: int, algorithm: str = "bfd", *,
               media_counts: Optional[Sequence[int]] = None, max_images: Optional[int] = None,
               kinds: Optional[Sequence[int]] = None, group_by_media: bool = False,
               balance_rounds: int = 2) -> list[np.ndarray]:
    """Packs as arrays of sample indices (ascending inside a pack), in the order they were opened;
    with ``group_by_media`` text packs come first, then image, then video packs.

    ``lengths``: tokens per sample, each in [1, seq_len]. ``media_counts``: images+videos per
    sample (needed with ``max_images``). ``kinds``: 0 text, 1 image, 2 video (for grouping).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, seq_len, algorithm, media_counts, max_images)
    media = np.zeros(len(lengths), np.int64) if media_counts is None else np.asarray(media_counts, np.int64)
    if not group_by_media:
        groups = [np.arange(len(lengths))]
    else:
        if kinds is None:
            raise ValueError("group_by_media needs kinds")
        kinds = np.asarray(kinds)
        groups = [np.flatnonzero(kinds == code) for code in range(len(MEDIA_KINDS))]
    packs: list[np.ndarray] = []
    for members in groups:
        if len(members) == 0:
            continue
        for local in _plan_one(lengths[members], media[members], seq_len, algorithm, max_images, balance_rounds):
            packs.append(np.sort(members[local]))
    return packs


def _check(lengths, seq_len, algorithm, media_counts, max_images) -> None:
    if algorithm not in ALGORITHMS + BASELINES:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(f"sample lengths must be in [1, {seq_len}], got [{lengths.min()}, {lengths.max()}]")
    if max_images is not None:
        if max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {max_images}")
        if algorithm in BASELINES:
            raise ValueError(f"max_images is not supported by the {algorithm} baseline")
        if media_counts is None:
            raise ValueError("max_images needs media_counts")
        if len(lengths) and int(np.max(media_counts)) > max_images:
            raise ValueError(f"a sample has {int(np.max(media_counts))} images/videos > max_images={max_images}")


def _plan_one(lengths, media, seq_len, algorithm, max_images, balance_rounds) -> list[np.ndarray]:
    decreasing = np.argsort(-lengths, kind="stable")
    if algorithm == "first_fit":
        bins = _first_fit(np.arange(len(lengths)), lengths, media, seq_len, None)
    elif algorithm == "ffd":
        bins = _first_fit(decreasing, lengths, media, seq_len, max_images)
    elif algorithm == "knapsack":
        return _greedy_knapsack(lengths, seq_len)
    elif algorithm == "balanced":
        packs = _spread_fit(lengths, media, seq_len, max_images)
        if packs is None:
            packs = _group_by_bin(_best_fit(decreasing, lengths, media, seq_len, max_images))
        return rebalance_quadratic(packs, lengths, media, seq_len, max_images, rounds=balance_rounds)
    else:
        bins = _best_fit(decreasing, lengths, media, seq_len, max_images)
    return _group_by_bin(bins)


def _group_by_bin(bins: np.ndarray) -> list[np.ndarray]:
    """Sample indices per bin id, bins in id order, indices ascending."""
    order = np.argsort(bins, kind="stable")
    counts = np.bincount(bins)
    return np.split(order, np.cumsum(counts)[:-1])


# ---------------------------------------------------------------- best fit


class _FreeIndex:
    """Open bins by free space: ``stacks[c]`` holds the bins with exactly c tokens free and
    ``present`` the sorted free values whose stack is non-empty."""

    def __init__(self, seq_len: int):
        self.stacks: list[list[int]] = [[] for _ in range(seq_len + 1)]
        self.present: list[int] = []

    def smallest_at_least(self, length: int) -> int:
        """Free value of the best fit for ``length``, or -1."""
        k = bisect.bisect_left(self.present, length)
        return self.present[k] if k < len(self.present) else -1

    def pick(self, length: int, worst: bool) -> int:
        """Free value of the best fit (smallest that fits) or worst fit (largest), or -1."""
        if not worst:
            return self.smallest_at_least(length)
        return self.present[-1] if self.present and self.present[-1] >= length else -1

    def pop(self, free: int) -> int:
        stack = self.stacks[free]
        chosen = stack.pop()
        if not stack:
            del self.present[bisect.bisect_left(self.present, free)]
        return chosen

    def push(self, free: int, bin_id: int) -> None:
        stack = self.stacks[free]
        if not stack:
            bisect.insort(self.present, free)
        stack.append(bin_id)

    def take_with_room(self, length, count, bin_media, max_images) -> tuple[int, int]:
        """Best-fitting bin with room for ``count`` more images, looking at a bounded number."""
        probes = 0
        k = bisect.bisect_left(self.present, length)
        while k < len(self.present) and probes < _IMAGE_PROBES:
            free = self.present[k]
            stack = self.stacks[free]
            for position in range(len(stack) - 1, max(-1, len(stack) - 1 - _IMAGE_PROBES), -1):
                probes += 1
                candidate = stack[position]
                if bin_media[candidate] + count <= max_images:
                    del stack[position]
                    if not stack:
                        del self.present[k]
                    return candidate, free
            k += 1
        return -1, 0


def _best_fit(order: np.ndarray, lengths: np.ndarray, media: np.ndarray, seq_len: int,
              max_images: Optional[int], *, spread_from: Optional[int] = None, preopen: int = 0) -> np.ndarray:
    """Bin id per sample. With ``max_images``, bins whose image cap is reached move to a second
    index that only text samples look at, so image samples never wade through them.

    ``spread_from``: samples of at least that many tokens go to the bin with the *most* free space
    (worst fit) instead, which spreads long samples over the ``preopen`` bins opened up front;
    shorter samples still best-fit into the gaps. Unused pre-opened bins stay empty."""
    with_room, image_full = _FreeIndex(seq_len), _FreeIndex(seq_len)
    bin_media: list[int] = [0] * preopen
    for bin_id in range(preopen - 1, -1, -1):  # popped from the end: bin 0 first
        with_room.push(seq_len, bin_id)
    bins = np.empty(len(lengths), np.int64)
    length_list, media_list = lengths.tolist(), media.tolist()
    for i in order.tolist():
        length, count = length_list[i], media_list[i]
        worst = spread_from is not None and length >= spread_from
        chosen, free = -1, seq_len
        if count == 0 or max_images is None:
            free, index = with_room.pick(length, worst), with_room
            other = image_full.pick(length, worst) if max_images is not None else -1
            if other >= 0 and (free < 0 or (other > free if worst else other < free)):
                free, index = other, image_full
            if free >= 0:
                chosen = index.pop(free)
        elif count == 1:
            free = with_room.pick(length, worst)
            if free >= 0:
                chosen = with_room.pop(free)
        else:
            chosen, free = with_room.take_with_room(length, count, bin_media, max_images)
        if chosen < 0:
            chosen, free = len(bin_media), seq_len
            bin_media.append(0)
        bins[i] = chosen
        bin_media[chosen] += count
        left = free - length
        if left > 0:
            full = max_images is not None and bin_media[chosen] >= max_images
            (image_full if full else with_room).push(left, chosen)
    return bins


def _spread_fit(lengths, media, seq_len, max_images) -> Optional[list[np.ndarray]]:
    """Packs that spread long samples (see ``_best_fit``), or None if they need more than
    ``_SPREAD_SLACK`` packs over the lower bound (ceil(tokens / seq_len), or of images / cap)."""
    lower_bound = -(-int(lengths.sum()) // seq_len)
    if max_images is not None:
        lower_bound = max(lower_bound, -(-int(media.sum()) // max_images))
    bins = _best_fit(np.argsort(-lengths, kind="stable"), lengths, media, seq_len, max_images,
                     spread_from=max(1, int(_SPREAD_FROM * seq_len)), preopen=lower_bound)
    packs = [p for p in _group_by_bin(bins) if len(p)]
    return packs if len(packs) <= lower_bound * (1 + _SPREAD_SLACK) + 1 else None


# ---------------------------------------------------------------- first fit


class _MaxTree:
    """Max segment tree over bins; leaves start at ``initial`` (an unopened bin is empty)."""

    def __init__(self, size: int, initial: int):
        self.size = 1 << max(1, (size - 1).bit_length())
        self.tree = [initial] * (2 * self.size)

    def leftmost_at_least(self, value: int) -> int:
        tree, node = self.tree, 1
        if tree[1] < value:
            return -1
        while node < self.size:
            node *= 2
            if tree[node] < value:
                node += 1
        return node - self.size

    def set(self, leaf: int, value: int) -> None:
        tree = self.tree
        node = leaf + self.size
        tree[node] = value
        node //= 2
        while node:
            best = tree[2 * node] if tree[2 * node] >= tree[2 * node + 1] else tree[2 * node + 1]
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2


def _first_fit(order: np.ndarray, lengths: np.ndarray, media: np.ndarray, seq_len: int,
               max_images: Optional[int]) -> np.ndarray:
    """Bin id per sample: each sample, in ``order``, goes to the lowest-numbered bin that fits.
    With ``max_images`` a second tree holds free space only of bins with image room left, which
    image samples search (skipping bins with too little room for all their images)."""
    capacity = int(min(len(lengths), 2 * -(-int(lengths.sum()) // seq_len) + 2))
    free_tree = _MaxTree(capacity, seq_len)
    image_tree = _MaxTree(capacity, seq_len) if max_images is not None else None
    free = [seq_len] * free_tree.size
    bin_media = [0] * free_tree.size
    opened = 0
    bins = np.empty(len(lengths), np.int64)
    length_list, media_list = lengths.tolist(), media.tolist()
    for i in order.tolist():
        length, count = length_list[i], media_list[i]
        if image_tree is not None and count > 0:
            chosen = _first_with_room(image_tree, length, count, bin_media, max_images, free)
        else:
            chosen = free_tree.leftmost_at_least(length)
        if chosen < 0:
            chosen = opened
        if chosen >= free_tree.size:  # every leaf opened: double the trees
            free_tree, image_tree, free, bin_media = _grow(free_tree, image_tree, free, bin_media,
                                                           seq_len, max_images)
        opened = max(opened, chosen + 1)
        bins[i] = chosen
        free[chosen] -= length
        bin_media[chosen] += count
        free_tree.set(chosen, free[chosen])
        if image_tree is not None:
            image_tree.set(chosen, free[chosen] if bin_media[chosen] < max_images else -1)
    return bins


def _first_with_room(image_tree, length, count, bin_media, max_images, free) -> int:
    """Lowest bin that fits ``length`` and has room for ``count`` images: bins lacking room
    are masked one by one (at most ``_IMAGE_PROBES``), then unmasked; -1 if none found."""
    masked, chosen = [], -1
    while len(masked) < _IMAGE_PROBES:
        candidate = image_tree.leftmost_at_least(length)
        if candidate < 0 or bin_media[candidate] + count <= max_images:
            chosen = candidate
            break
        masked.append(candidate)
        image_tree.set(candidate, -1)
    for leaf in masked:
        image_tree.set(leaf, free[leaf])
    return chosen


def _grow(free_tree, image_tree, free, bin_media, seq_len, max_images):
    size = free_tree.size * 2
    free = free + [seq_len] * (size - len(free))
    bin_media = bin_media + [0] * (size - len(bin_media))
    new_free = _MaxTree(size, seq_len)
    new_image = _MaxTree(size, seq_len) if image_tree is not None else None
    for leaf in range(free_tree.size):
        new_free.set(leaf, free[leaf])
        if new_image is not None:
            new_image.set(leaf, free[leaf] if bin_media[leaf] < max_images else -1)
    return new_free, new_image, free, bin_media


# ---------------------------------------------------------------- greedy knapsack baseline


def _greedy_knapsack(lengths: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """One pack at a time: start with the largest remaining sample, then repeatedly add the
    largest remaining sample that still fits (earliest first among equal lengths)."""
    by_length: dict[int, list[int]] = {}
    for i in np.argsort(lengths, kind="stable")[::-1].tolist():  # pops give arrival order
        by_length.setdefault(int(lengths[i]), []).append(i)
    present = sorted(by_length)
    packs = []
    while present:
        free, pack = seq_len, []
        k = len(present) - 1
        while k >= 0:
            length = present[k]
            stack = by_length[length]
            pack.append(stack.pop())
            free -= length
            if not stack:
                del present[k]
            k = bisect.bisect_right(present, free) - 1
        packs.append(np.sort(np.asarray(pack, np.int64)))
    return packs


# ---------------------------------------------------------------- quadratic balancing


def quadratic_costs(packs: Sequence[np.ndarray], lengths: np.ndarray) -> np.ndarray:
    """Attention cost per pack: sum of L^2 over its samples (float64)."""
    squares = lengths.astype(np.float64) ** 2
    return np.array([squares[p].sum() for p in packs])


def rebalance_quadratic(packs: list[np.ndarray], lengths: np.ndarray, media: np.ndarray, seq_len: int,
                        max_images: Optional[int], rounds: int = 4) -> list[np.ndarray]:
    """Even out sum L^2 across packs without changing their number (so fill is unchanged).

    Each round sorts packs by cost and pairs the i-th heaviest with the i-th lightest; the pair's
    samples are re-split longest first, each to the cheaper side that fits, and the split is kept
    only if it fits and lowers the pair's maximum cost.
    """
    packs = list(packs)
    squares = lengths.astype(np.float64) ** 2
    costs = quadratic_costs(packs, lengths)
    largest = np.array([squares[p].max() for p in packs])
    length_list, media_list = lengths.tolist(), media.tolist()
    for _ in range(rounds):
        order = np.argsort(costs, kind="stable")
        half = len(order) // 2
        heavy, light = order[::-1][:half], order[:half]
        # No split can go below the larger of the two biggest samples or the pair's mean: skip
        # pairs where that bound leaves less than 1% to gain (most pairs on long-tailed data).
        bound = np.maximum(np.maximum(largest[heavy], largest[light]), (costs[heavy] + costs[light]) / 2)
        candidates = np.flatnonzero(bound < 0.99 * costs[heavy])
        changed = False
        for j in candidates.tolist():
            h, l = int(heavy[j]), int(light[j])
            split = _resplit(packs[h].tolist() + packs[l].tolist(), length_list, media_list, seq_len, max_images)
            if split is None:
                continue
            (left, left_cost), (right, right_cost) = split
            if max(left_cost, right_cost) < costs[h]:
                packs[h], packs[l] = left, right
                costs[h], costs[l] = left_cost, right_cost
                largest[h], largest[l] = squares[left].max(), squares[right].max()
                changed = True
        if not changed:
            break
    return packs


def _resplit(members: list[int], lengths: list[int], media: list[int], seq_len: int, max_images):
    members.sort(key=lambda i: (-lengths[i], i))
    sides: list[list[int]] = [[], []]
    cost, free, images = [0.0, 0.0], [seq_len, seq_len], [0, 0]
    for i in members:
        length, count = lengths[i], media[i]
        first = 0 if cost[0] <= cost[1] else 1
        for side in (first, 1 - first):
            if length <= free[side] and (max_images is None or images[side] + count <= max_images):
                sides[side].append(i)
                cost[side] += float(length) * length
                free[side] -= length
                images[side] += count
                break
        else:
            return None
    if not sides[0] or not sides[1]:
        return None
    return ((np.asarray(sorted(sides[0]), np.int64), cost[0]),
            (np.asarray(sorted(sides[1]), np.int64), cost[1]))


# ---------------------------------------------------------------- summaries


def fill_ratio(packs: Sequence[np.ndarray], lengths: np.ndarray, seq_len: int) -> float:
    """Real tokens / (packs x seq_len); 0.0 without packs."""
    if not len(packs):
        return 0.0
    return float(sum(int(lengths[p].sum()) for p in packs)) / (len(packs) * seq_len)
