"""``loongforge profile --sweep``: micro-batches from a designed grid instead of the dataset.

A cost model fitted on a narrow dataset (every sample about the same length, every image the same
size) cannot separate the L^2, L and N terms. The sweep covers the space on purpose, cycling
through five row designs with lengths on a geometric grid from 64 tokens to ``data.seq_len`` and
images from 4x4 patches to the largest ``data.max_pixels`` allows (square and 1:2, in pixels, each planned
by the family's own image processor: Qwen's smart-resized grid, InternVL's tiles, LLaVA-OneVision's anyres
squares or a padded square where it shares its sample):

  single        one text-only sample of length L
  packed_equal  k text-only samples of one length (k = 2, 4, 8, ...)
  packed_mixed  one long sample plus short ones (the long-tail case balancing is about)
  image_single  one sample with one or two images of one size
  image_packed  several image samples of different sizes, with text-only samples

Rows follow the ``data.collate`` contract exactly (random token ids, each image's placeholders as
``data.measure`` writes them (between the vision markers where the family's format has them), positions
from the family's ``position_ids``, an answer-like loss mask over the end of each sample (the share varies
around ``--answer-share``), random patch rows with each image's grid, size and processor facts), so
the model runs the same code as on real data. Step ``s`` always gets the same rows on every
rank; DP rank ``r`` trains on its block of the step's rows, like the data pipeline.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from loongforge.config.schema import RunConfig
from loongforge.data.collate import stacked_facts
from loongforge.data.packing import rank_rows
from loongforge.models import parts
from loongforge.models.family import ChatFormat
from loongforge.models.media import ImagePlan, MediaBatch, MediaSet
from loongforge.models.registry import get_family

ROW_DESIGNS = ("single", "packed_equal", "packed_mixed", "image_single", "image_packed")
MIN_LENGTH = 64
# Default share of each sample's tokens with loss (answers). The LM head runs on loss tokens
# only, so the sweep should match the training data's share (`profile --answer-share`): with a
# large vocabulary and a small model the head is most of the cost.
ANSWER_SHARE = 0.25
ANSWER_SHARE_FACTORS = (0.5, 1.0, 1.5)  # per-sample share = mean share x one of these
# Text token ids drawn below the Qwen special tokens.
_TEXT_VOCAB = 150_000


def length_grid(seq_len: int, points: int = 8) -> list[int]:
    """Geometric grid of sample lengths from MIN_LENGTH to seq_len (inclusive)."""
    top = max(seq_len, MIN_LENGTH)
    return sorted({int(round(MIN_LENGTH * (top / MIN_LENGTH) ** (i / (points - 1))))
                   for i in range(points)})


def image_grids(max_pixels: int, patch_size: int, merge: int) -> list[tuple[int, int]]:
    """(h, w) patch grids, multiples of the merge size, from 4x4 to the largest max_pixels allows."""
    side_max = max(merge, int(math.sqrt(max_pixels) // (patch_size * merge)) * merge)
    sides = sorted({s for s in (4, 8, 12, 16, 24, 32, 48, 64) if s <= side_max} | {side_max})
    grids = [(s, s) for s in sides]
    grids += [(s, 2 * s) for s in sides if 2 * s <= side_max]
    return grids


Size = tuple[int, int]  # an image's (height, width) in pixels
# An image's tokens in its sample (placeholders and markers), given its size and the sample's image count.
ImageTokens = Callable[[Size, int], int]


class SweepDesign:
    """The deterministic sequence of designed rows: row ``i`` -> [(text_len, [(height, width), ...]), ...]."""

    def __init__(self, seq_len: int, sizes: list[Size], image_tokens: ImageTokens, seed: int):
        self.seq_len = seq_len
        self.lengths = length_grid(seq_len)
        self.sizes = sizes
        self.image_tokens = image_tokens
        self.seed = seed
        # A text-only model (no image sizes) cycles through the text designs only.
        self.designs = ROW_DESIGNS if sizes else tuple(d for d in ROW_DESIGNS if not d.startswith("image"))

    def row(self, index: int) -> list[tuple[int, list[tuple[int, int]]]]:
        rng = np.random.default_rng([self.seed, index])
        design = self.designs[index % len(self.designs)]
        lengths, cap = self.lengths, self.seq_len
        if design == "single":
            return [(int(rng.choice(lengths)), [])]
        if design == "packed_equal":
            k = int(rng.choice([2, 4, 8]))
            fitting = [L for L in lengths if k * L <= cap] or [max(MIN_LENGTH // 2, cap // k)]
            return [(int(rng.choice(fitting)), [])] * k
        if design == "packed_mixed":
            long = int(rng.choice(lengths[len(lengths) // 2:]))
            row, room = [(long, [])], cap - long
            while room >= MIN_LENGTH and len(row) < 8:
                short = int(rng.choice([L for L in lengths if L <= room]))
                row.append((short, []))
                room -= short
            return row
        return self._image_row(rng, single=design == "image_single")

    def _image_row(self, rng, *, single: bool):
        row, room = [], self.seq_len
        for _ in range(1 if single else int(rng.integers(2, 5))):
            fitting = [size for size in self.sizes if self.image_tokens(size, 1) + MIN_LENGTH <= room]
            if not fitting:
                break
            count = int(rng.integers(1, 3)) if single else 1
            size = fitting[int(rng.integers(len(fitting)))]
            # A processor may plan an image differently when it shares its sample (LLaVA-OneVision).
            image_tokens = count * self.image_tokens(size, count)
            if count > 1 and image_tokens + MIN_LENGTH > room:
                count, image_tokens = 1, self.image_tokens(size, 1)
            text = int(rng.choice([L for L in self.lengths if L <= room - image_tokens] or [MIN_LENGTH]))
            row.append((text, [size] * count))
            room -= text + image_tokens
        if not single and room >= MIN_LENGTH:
            row.append((int(rng.choice([L for L in self.lengths if L <= room])), []))
        return row or [(MIN_LENGTH, [])]


def image_markers(chat: ChatFormat) -> bool:
    """Whether an image's placeholders sit between the vision start and end tokens in a written sample: the
    processor wraps them (``wraps_images``) or the format's image block writes the markers itself."""
    start = dict((field, text) for text, field in chat.vision_tokens).get("vision_start_token_id")
    return chat.wraps_images or (start is not None and start in chat.image_block)


class SweepSource:
    """Drop-in for ``DataPipeline`` in the runner: ``next_step()`` returns this rank's rows."""

    def __init__(self, cfg: RunConfig, *, dp_rank: int, dp_size: int, pad_to_multiple: int,
                 answer_share: float = ANSWER_SHARE):
        if not 0 < answer_share <= 1:
            raise ValueError(f"answer_share must be in (0, 1], got {answer_share}")
        self.answer_share = answer_share
        model, data = cfg.model, cfg.data
        family = get_family(model.family)
        self.tokens = model.tokens
        # Text ids below every special token the model knows (a vision token drawn as text would
        # make a row the model refuses; -1 marks a token the family has none of) and inside its
        # vocabulary (Llama's is smaller).
        tokens = model.tokens
        special = [tokens.pad_token_id, *((tokens.image_token_id, tokens.video_token_id, tokens.vision_start_token_id,
                                           tokens.vision_end_token_id) if model.vision is not None else ())]
        self.text_vocab = min(_TEXT_VOCAB, model.language.vocab_size, *(i for i in special if i > 0))
        self.position_ids = family.position_ids(model)
        if model.vision is None:  # a text-only model: text designs only
            self.images, self.markers, sizes = None, False, []
        else:
            self.images = parts.image_processing(family, model, data)
            self.markers = image_markers(family.chat(model))
            sizes = [(h * model.vision.patch_size, w * model.vision.patch_size)
                     for h, w in image_grids(data.max_pixels, model.vision.patch_size,
                                             model.projector.spatial_merge_size)]
        self.design = SweepDesign(data.seq_len, sizes, self.image_tokens, data.seed)
        self.global_batch_size = cfg.training.global_batch_size
        self.my_rows = rank_rows(self.global_batch_size, dp_rank, dp_size)
        self.pad_to_multiple = pad_to_multiple
        self.step = 0

    def next_step(self) -> list[dict]:
        first = self.step * self.global_batch_size
        self.step += 1
        return [self.micro_batch(first + i, self.design.row(first + i)) for i in self.my_rows]

    def _plan(self, size: Size, images_in_sample: int) -> ImagePlan:
        height, width = size
        return self.images.plan(width, height, images_in_sample)

    def image_tokens(self, size: Size, images_in_sample: int) -> int:
        """An image's tokens in its sample: its placeholders, and the vision markers around them where the
        family's format has them."""
        return self._plan(size, images_in_sample).tokens + 2 * self.markers

    def _sample(self, rng, text_len: int, sizes: list[Size]) -> tuple[torch.Tensor, torch.Tensor, list[ImagePlan]]:
        t = self.tokens
        plans = [self._plan(size, len(sizes)) for size in sizes]
        text = rng.integers(0, self.text_vocab, size=text_len)
        pieces = [text[: text_len // 2]]
        for plan in plans:
            pads = np.full(plan.tokens, t.image_token_id)
            pieces += [np.array([t.vision_start_token_id]), pads, np.array([t.vision_end_token_id])] \
                if self.markers else [pads]
        pieces.append(text[text_len // 2:])
        ids = torch.from_numpy(np.concatenate(pieces)).long()
        grids = torch.tensor([plan.grid for plan in plans]) if plans else None  # [n, 3]
        return ids, self.position_ids(ids, grids, None, None), plans

    def micro_batch(self, row_index: int, row) -> dict:
        rng = np.random.default_rng([self.design.seed, row_index, 1])
        ids, positions, labels, masks, plans = [], [], [], [], []
        for text_len, sample_sizes in row:
            sample_ids, sample_pos, sample_plans = self._sample(rng, text_len, sample_sizes)
            L = len(sample_ids)
            sample_labels = torch.zeros_like(sample_ids)
            sample_labels[:-1] = sample_ids[1:]
            # Answer shares vary around the mean so the loss-token term (the LM head runs on
            # those only) can be told apart from sum L.
            share = min(0.95, self.answer_share * float(rng.choice(ANSWER_SHARE_FACTORS)))
            mask = torch.zeros(L)
            mask[L - max(2, int(L * share)):L - 1] = 1.0
            ids.append(sample_ids), positions.append(sample_pos), labels.append(sample_labels)
            masks.append(mask)
            plans += sample_plans
        lengths = [len(x) for x in ids]
        real = sum(lengths)
        pad = -(-real // self.pad_to_multiple) * self.pad_to_multiple - real
        if pad:
            ids.append(torch.full((pad,), self.tokens.pad_token_id, dtype=torch.long))
            labels.append(torch.zeros(pad, dtype=torch.long))
            masks.append(torch.zeros(pad))
            positions.append(torch.arange(pad).expand(3, -1))
        loss_mask = torch.cat(masks)[None]
        return {
            "input_ids": torch.cat(ids)[None],
            "labels": torch.cat(labels)[None],
            "loss_mask": loss_mask,
            "position_ids": torch.cat(positions, dim=1)[:, None, :].contiguous(),
            "cu_seqlens": torch.as_tensor(np.cumsum([0, *lengths, *([pad] if pad else [])]),
                                          dtype=torch.int32),
            "media": MediaBatch(images=self._media(rng, plans, row) if plans else None),
            "num_loss_tokens": int(loss_mask.sum()),
            "sample_lengths": lengths,
            "sample_ids": [f"sweep:{row_index}:{i}" for i in range(len(row))],
        }

    def _media(self, rng, plans: list[ImagePlan], row) -> MediaSet:
        """The row's images as collate gives them: random patch rows in each planned grid."""
        patches = sum(t * h * w for t, h, w in (plan.grid for plan in plans))
        return MediaSet(
            grids=torch.tensor([plan.grid for plan in plans]),  # [n, 3]
            rows=torch.from_numpy(rng.standard_normal((patches, self.images.patch_dim), dtype=np.float32)),
            sizes=torch.tensor([plan.size for plan in plans]),  # [n, 2] (height, width)
            facts=stacked_facts([plan.facts for plan in plans], len(plans)),
            samples=tuple(index for index, (_, sample_sizes) in enumerate(row) for _ in sample_sizes))

    # The DataPipeline interface the runner uses.
    def state_dict(self) -> dict:
        return {"sweep_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("sweep_step", 0))

    def reject_counts(self) -> dict:
        return {}

    def close(self) -> None:
        pass
