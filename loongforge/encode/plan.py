"""What ``loongforge encode`` will encode, and which process writes which shard.

Every process computes the same plan from the same inputs: the media of every sample in input
order (sizes from image headers and video containers, no pixels decoded), then each medium's rank
by modelled encoder cost (``parallel.media_assign``: longest first onto the least-loaded rank),
then each rank's media, in input order, cut into shards of about ``shard_tokens`` output rows. So
a shard's content is fixed before anything runs, and a resumed run rewrites exactly the shards a
killed one did not finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from loongforge.config.schema import DataConfig
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.measure import MeasuredSample, measure_media
from loongforge.data.packfile.reader import PackedFolder
from loongforge.data.record_kinds import reading_for
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.vision import ImageSource, MediaError, VideoPlan, VisionSizing
from loongforge.parallel.media_assign import assign_media


@dataclass(frozen=True)
class EncodeItem:
    """One image or video to encode."""

    order: int  # position in the plan (input order)
    sample_order: int  # the sample's position in the input
    sample_id: str
    file: str
    line: int
    kind: str  # "image" | "video"
    media_index: int
    source: Union[ImageSource, str]
    grid: tuple[int, int, int]
    video_plan: Optional[VideoPlan] = None
    record: Optional[int] = None  # the sample's ConversationSample.record: what names it, with file
    # An image's (height, width) in pixels and the images of its sample: a tower that packs an image's
    # features by its size, or treats a sample's several images otherwise, reads them.
    size: tuple[int, int] = (0, 0)
    images_in_sample: int = 1
    facts: Mapping[str, Any] = field(default_factory=dict)  # an image's processor facts (``ImagePlan.facts``)

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


@dataclass
class EncodePlan:
    items: list[EncodeItem]
    # (sample position, reject): samples unreadable or whose media cannot be read (sizes)
    rejects: list[tuple[int, Reject]]
    samples: int  # samples read, rejected ones included

    def shards(self, rank: int, world_size: int, *, merge_unit: int, shard_tokens: int) -> list[list[EncodeItem]]:
        """This rank's shards: its media in input order, each shard closed once it holds at least
        ``shard_tokens`` output rows."""
        owners = assign_media([item.patches for item in self.items], world_size)
        shards, current, tokens = [], [], 0
        for item, owner in zip(self.items, owners):
            if owner != rank:
                continue
            current.append(item)
            tokens += item.patches // merge_unit
            if tokens >= shard_tokens:
                shards.append(current)
                current, tokens = [], 0
        return shards + ([current] if current else [])


def plan_files(files: list[str], sizing: VisionSizing, data_cfg: DataConfig) -> EncodePlan:
    """The plan of conversation files (the formats ``train`` reads)."""
    source = ArrowSamples(files, data_cfg.cache_dir, reading=reading_for(data_cfg))
    items, rejects = [], []
    for index in range(len(source)):
        sample = source.get(index)
        if isinstance(sample, Reject):
            rejects.append((index, sample))
            continue
        try:
            image_plans, video_plans = measure_media(sample, sizing, data_cfg)
        except MediaError as error:
            rejects.append((index, Reject.of(sample, error.reason, error.detail)))
            continue
        items += _sample_items(sample, [plan.grid for plan in image_plans], video_plans, first=len(items),
                               sample_order=index, image_sizes=[plan.size for plan in image_plans],
                               image_facts=[plan.facts for plan in image_plans])
    return EncodePlan(items=items, rejects=rejects, samples=len(source))


def plan_packed(folder: PackedFolder) -> EncodePlan:
    """The plan of a ``loongforge pack`` folder: its samples' media as pack measured them."""
    items, samples = [], 0
    for pack in range(len(folder)):
        for sample in folder.pack(pack):
            items += _sample_items(sample, sample.image_grids, sample.video_plans, first=len(items),
                                   sample_order=samples, image_sizes=sample.image_sizes,
                                   image_facts=sample.image_facts)
            samples += 1
    return EncodePlan(items=items, rejects=[], samples=samples)


def _sample_items(sample: Union[ConversationSample, MeasuredSample], image_grids: list, video_plans: list,
                  first: int, sample_order: int, image_sizes: list, image_facts: list) -> list[EncodeItem]:
    common = dict(sample_id=sample.sample_id, file=sample.file, line=sample.line, record=sample.record,
                  sample_order=sample_order)
    sizes = list(image_sizes) or [(0, 0)] * len(image_grids)  # none in folders packed before sizes were kept
    facts = list(image_facts) or [{}] * len(image_grids)  # none where the processor gives none
    items = [EncodeItem(order=first + i, kind="image", media_index=i, source=image, grid=tuple(grid),
                        size=tuple(size), images_in_sample=len(sample.images), facts=dict(item_facts), **common)
             for i, (image, grid, size, item_facts) in enumerate(zip(sample.images, image_grids, sizes, facts))]
    items += [EncodeItem(order=first + len(items) + i, kind="video", media_index=i, source=video,
                         grid=tuple(plan.grid_thw), video_plan=plan, **common)
              for i, (video, plan) in enumerate(zip(sample.videos, video_plans))]
    return items
