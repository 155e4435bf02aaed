"""The two per-sample phases of the pipeline.

measure (every rank, every sample): tokenize the rendered chat, read image sizes from headers and
video sizes/frame counts from containers, and expand each media pad token to its exact count
(a family with ``ChatFormat.timestamped_video_frames`` gets Qwen3-VL's per-temporal-patch video
blocks with timestamp text, ``data.video_tokens``).
This gives the exact LLM length used for packing, without decoding any pixel. A pretraining
document (``TextSample``) is its text's tokens and the format's ``document_end`` token, every one a
loss token; one longer than ``data.seq_len`` is measured whole and cut into row-sized pieces by
``document_pieces`` (the row streams do it; nothing else packs such a sample).

materialize (only the rank that trains on the sample): decode media into ``pixel_values``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

import numpy as np

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.samples import ConversationSample, Reject, Sample, TextSample
from loongforge.data.template import expand_media_tokens, render_chat, replace_media_tokens, tokenize_chat
from loongforge.data.video_tokens import timestamped_video_ids
from loongforge.data.vision import (
    ImageSource,
    MediaError,
    VideoPlan,
    VisionSizing,
    decode_video_frames,
    load_rgb_image,
    num_llm_tokens,
    plan_video,
    preprocess_video,
    probe_image_size,
    probe_video,
)
from loongforge.models import parts
from loongforge.models.family import ChatFormat
from loongforge.models.media import ImagePlan
from loongforge.models.registry import get_family


@dataclass
class MeasuredSample:
    """A sample ready to pack: final token ids and the media plans that produce its pixels."""

    sample_id: str
    file: str
    line: int
    input_ids: np.ndarray  # int64 [L], media pads expanded
    is_answer: np.ndarray  # bool [L], True on assistant answer tokens and their end-of-turn token
    images: list[ImageSource] = field(default_factory=list)
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    # (height, width) of each image in pixels, from its header: a tower that packs an image's features
    # by its size reads them (LLaVA-OneVision's anyres); [] in folders packed before they were kept.
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    # Each image's facts from its tower's processor (``ImagePlan.facts``); [] where it gives none, and in
    # folders packed before they were kept.
    image_facts: list[dict] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    video_plans: list[VideoPlan] = field(default_factory=list)
    record: Optional[int] = None  # as ConversationSample.record
    # A pretraining document: may be longer than data.seq_len, then cut by ``document_pieces``.
    document: bool = False
    piece: Optional[int] = None  # which piece of a cut document (0, 1, ...); None: the whole sample

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        """Positions trained with loss: labels are the next token, so every answer token but one
        at position 0 is predicted from the position before it (``collate``'s loss_mask)."""
        return int(self.is_answer[1:].sum())


@dataclass
class MaterializedSample:
    """Pixels for one measured sample; ``late_reject`` is set when decoding failed after packing
    (the sample keeps its row slot with zero pixels and no loss)."""

    sample: MeasuredSample
    image_pixels: list[np.ndarray]  # float32 [grid_t*grid_h*grid_w, patch_dim] each
    video_pixels: list[np.ndarray]
    late_reject: Reject | None = None
    # With data.vision_embeddings: stored encoder features [tokens, LM hidden] instead of pixels.
    image_embeds: list = field(default_factory=list)
    video_embeds: list = field(default_factory=list)


def vision_sizing(data_cfg: DataConfig, model_cfg: ModelConfig) -> Optional[VisionSizing]:
    """How images and videos become patches; None for a text-only model (it takes no media)."""
    if model_cfg.vision is None:
        return None
    family = get_family(model_cfg.family)
    return VisionSizing(
        patch_size=model_cfg.vision.patch_size,
        temporal_patch_size=model_cfg.vision.temporal_patch_size,
        merge_size=model_cfg.projector.spatial_merge_size,
        min_pixels=data_cfg.min_pixels,
        max_pixels=data_cfg.max_pixels,
        video_min_pixels=data_cfg.video_min_pixels,
        video_max_pixels=data_cfg.video_max_pixels,
        pixel_mean=tuple(model_cfg.vision.pixel_mean),
        pixel_std=tuple(model_cfg.vision.pixel_std),
        video_rule=family.chat(model_cfg).video_rule,
        images=parts.image_processing(family, model_cfg, data_cfg),
    )


class SampleMeasurer:
    def __init__(self, tokenizer, data_cfg: DataConfig, model_cfg: ModelConfig):
        self.tokenizer = tokenizer
        self.data_cfg = data_cfg
        self.sizing = vision_sizing(data_cfg, model_cfg)
        self.chat = get_family(model_cfg.family).chat(model_cfg)
        self.tokens = model_cfg.tokens
        self.vision_token_ids = np.asarray(
            [self.tokens.image_token_id, self.tokens.video_token_id, self.tokens.vision_start_token_id,
             self.tokens.vision_end_token_id]
        )
        self.vocab_size = model_cfg.language.vocab_size
        check_token_ids(tokenizer, data_cfg, model_cfg, self.chat)
        self.document_start_ids, self.document_end_id = document_marker_ids(tokenizer, data_cfg, self.chat)

    def measure(self, sample: Sample) -> Union[MeasuredSample, Reject]:
        if isinstance(sample, TextSample):
            return self._measure_document(sample)
        if self.sizing is None and (sample.images or sample.videos):
            return Reject.of(sample, "media_in_text_model", f"{len(sample.images)} image(s), "
                                                            f"{len(sample.videos)} video(s) for a model without a vision tower")
        if sample.videos and not self.chat.video_block:
            return Reject.of(sample, "video_in_image_model", f"{len(sample.videos)} video(s) for a model whose "
                                                             "processor takes images only; give the frames as images")
        try:
            image_plans, video_plans = measure_media(sample, self.sizing, self.data_cfg)
        except MediaError as error:
            return Reject.of(sample, error.reason, error.detail)
        chat = tokenize_chat(self.tokenizer, render_chat(sample.turns, self.data_cfg.system_prompt, self.chat))
        try:
            input_ids, is_answer = self._expand_media(chat.input_ids, chat.is_answer, image_plans, video_plans)
        except ValueError as error:  # literal <|image_pad|> typed into the text
            return Reject.of(sample, "media_mismatch", str(error))
        # Vision markers are inputs, never targets, even if a placeholder sat in an answer.
        is_answer &= ~np.isin(input_ids, self.vision_token_ids)
        if len(input_ids) and input_ids.max() >= self.vocab_size:
            token_id = int(input_ids.max())
            return Reject.of(sample, "beyond_vocabulary",
                             f"{self.tokenizer.convert_ids_to_tokens(token_id)} (id {token_id}) is in the text, but "
                             f"model.language.vocab_size={self.vocab_size} gives it no embedding row")
        if len(input_ids) > self.data_cfg.seq_len:
            return Reject.of(sample, "too_long",
                             f"{len(input_ids)} tokens > data.seq_len={self.data_cfg.seq_len}")
        return MeasuredSample(
            sample_id=sample.sample_id, file=sample.file, line=sample.line, input_ids=input_ids,
            is_answer=is_answer, images=list(sample.images), image_grids=[plan.grid for plan in image_plans],
            image_sizes=[plan.size for plan in image_plans], image_facts=_kept_facts(image_plans),
            videos=list(sample.videos), video_plans=video_plans, record=sample.record,
        )

    def _measure_document(self, sample: TextSample) -> MeasuredSample:
        """The format's ``text_start`` (if any), the text and the end-of-document token, all loss
        tokens: the model learns to end documents. Special-token names inside the text stay plain
        text, so a scraped page holding "<|endoftext|>" or "<|image_pad|>" neither ends early nor
        asks for an image."""
        text_ids = self.tokenizer(sample.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        input_ids = np.asarray([*self.document_start_ids, *text_ids, self.document_end_id], dtype=np.int64)
        return MeasuredSample(sample_id=sample.sample_id, file=sample.file, line=sample.line, input_ids=input_ids,
                              is_answer=np.ones(len(input_ids), dtype=bool), record=sample.record, document=True)

    def _expand_media(self, input_ids, is_answer, image_plans: list[ImagePlan], video_plans):
        if not image_plans and not video_plans:
            return input_ids, is_answer
        merge = self.sizing.merge_size
        input_ids, is_answer = self._expand_images(input_ids, is_answer, image_plans)
        if self.chat.timestamped_video_frames:
            blocks = [timestamped_video_ids(plan, self.tokenizer, self.tokens, self.sizing.temporal_patch_size, merge)
                      for plan in video_plans]
            return replace_media_tokens(input_ids, is_answer, self.tokens.video_token_id, blocks)
        return expand_media_tokens(
            input_ids, is_answer, self.tokens.video_token_id,
            [num_llm_tokens(plan.grid_thw, merge) for plan in video_plans],
        )

    def _expand_images(self, input_ids, is_answer, image_plans: list[ImagePlan]):
        """Each image's pad -> its placeholder tokens (wrapped in the vision markers where the
        format's processor writes them: ``ChatFormat.wraps_images``)."""
        pad = self.tokens.image_token_id
        if not self.chat.wraps_images:
            return expand_media_tokens(input_ids, is_answer, pad, [plan.tokens for plan in image_plans])
        start, end = self.tokens.vision_start_token_id, self.tokens.vision_end_token_id
        blocks = [np.asarray([start, *[pad] * plan.tokens, end], dtype=np.int64) for plan in image_plans]
        return replace_media_tokens(input_ids, is_answer, pad, blocks)


def document_pieces(sample: MeasuredSample, seq_len: int) -> list[MeasuredSample]:
    """``sample`` as rows can hold it: itself when it fits, else (a document longer than
    ``seq_len``) consecutive pieces of ``seq_len`` tokens, the last one shorter, each packed as a
    sample of its own (its own segment: no attention across the cut). Every token is kept once;
    only the prediction across each cut is lost (a piece's first token has no token before it)."""
    if sample.length <= seq_len:
        return [sample]
    if not sample.document:
        raise ValueError(f"sample {sample.sample_id} has {sample.length} tokens > seq_len {seq_len}")
    return [replace(sample, sample_id=f"{sample.sample_id}#{piece}", input_ids=sample.input_ids[start:start + seq_len],
                    is_answer=sample.is_answer[start:start + seq_len], piece=piece)
            for piece, start in enumerate(range(0, sample.length, seq_len))]


def measure_media(sample: ConversationSample, sizing: VisionSizing,
                  data_cfg: DataConfig) -> tuple[list[ImagePlan], list[VideoPlan]]:
    """Each image's plan (grid and tokens, from its header, by the tower's processing) and each
    video's frame plan (from its container), without decoding pixels; MediaError on the first medium
    that is missing or unreadable."""
    image_plans = [image_plan(image, sizing, len(sample.images)) for image in sample.images]
    video_plans = [_video_plan(video, sizing, data_cfg) for video in sample.videos]
    return image_plans, video_plans


def _kept_facts(image_plans: list[ImagePlan]) -> list[dict]:
    """The images' facts to keep with the sample: [] where the processor gives none (the common case)."""
    facts = [dict(plan.facts) for plan in image_plans]
    return facts if any(facts) else []


def image_plan(image: ImageSource, sizing: VisionSizing, images_in_sample: int = 1) -> ImagePlan:
    """One image's grid and placeholder tokens from its header (``models.media``); MediaError."""
    width, height = probe_image_size(image)
    try:
        return sizing.images.plan(width, height, images_in_sample)
    except ValueError as error:  # extreme aspect ratio
        raise MediaError("corrupt_image", f"{_name(image)}: {error}") from None


def _video_plan(video: str, sizing: VisionSizing, data_cfg: DataConfig) -> VideoPlan:
    probe = probe_video(video)
    try:
        return plan_video(probe, sizing, data_cfg.video_fps, data_cfg.video_max_frames)
    except ValueError as error:
        raise MediaError("corrupt_image", f"{video}: {error}") from None


def materialize(sample: MeasuredSample, sizing: VisionSizing) -> MaterializedSample:
    """Decode and patchify this sample's media; a decode failure (file changed or corrupt past
    its header) yields zero pixels of the planned shape and a late reject, never an exception."""
    try:
        count = len(sample.images)
        images = [image_pixels(image, grid, sizing, count) for image, grid in zip(sample.images, sample.image_grids)]
        videos = [video_pixels(video, plan, sizing) for video, plan in zip(sample.videos, sample.video_plans)]
        return MaterializedSample(sample=sample, image_pixels=images, video_pixels=videos)
    except MediaError as error:
        reject = Reject.of(sample, error.reason,
                           f"{error.detail} (found when decoding; sample trained with no loss)")
    return MaterializedSample(
        sample=sample,
        image_pixels=[_zeros(grid, sizing.images.patch_dim) for grid in sample.image_grids],
        video_pixels=[_zeros(plan.grid_thw, sizing.patch_dim) for plan in sample.video_plans],
        late_reject=reject,
    )


def image_tokens(sample: MeasuredSample, sizing: VisionSizing) -> list[int]:
    """Each image's placeholder tokens, as measuring counted them (the tower's processing, from the
    image's size where the sample kept it; a grid's merged patches in folders packed before sizes were)."""
    if len(sample.image_sizes) == len(sample.images):
        return [sizing.images.plan(width, height, len(sample.images)).tokens for height, width in sample.image_sizes]
    merge_unit = sizing.merge_size**2
    return [t * h * w // merge_unit for t, h, w in sample.image_grids]


def image_pixels(image: ImageSource, grid: tuple[int, int, int], sizing: VisionSizing,
                 images_in_sample: int = 1) -> np.ndarray:
    """float32 [t*h*w, patch_dim] of one image measured with ``grid`` (by the tower's processing);
    MediaError if it cannot be decoded or decodes to another size than its header said."""
    pixels, decoded_grid = sizing.images.pixels(load_rgb_image(image), images_in_sample)
    if decoded_grid != grid:  # header and decoded size disagree
        raise MediaError("corrupt_image", f"{_name(image)}: decoded grid {decoded_grid} != header grid {grid}")
    return pixels


def video_pixels(video: str, plan: VideoPlan, sizing: VisionSizing) -> np.ndarray:
    """float32 [t*h*w, patch_dim] of one video's planned frames; MediaError if they cannot be decoded."""
    return preprocess_video(decode_video_frames(video, plan.frame_indices), plan, sizing)


def _zeros(grid: tuple[int, int, int], patch_dim: int) -> np.ndarray:
    grid_t, grid_h, grid_w = grid
    return np.zeros((grid_t * grid_h * grid_w, patch_dim), dtype=np.float32)


def _name(image: ImageSource) -> str:
    return image if isinstance(image, str) else f"<in-memory {type(image).__name__}>"


def check_token_ids(tokenizer, data_cfg: DataConfig, model_cfg: ModelConfig, chat: ChatFormat) -> None:
    """The tokenizer, model.tokens and the chat format must agree: vision tokens would land on the
    wrong ids, a text model's padding on a real token, a format's markers be split as plain text,
    an id beyond the embedding fail deep inside a step."""
    if model_cfg.vision is not None:
        _check_vision_token_ids(tokenizer, model_cfg, chat)
    else:
        _check_pad_token_id(tokenizer, model_cfg.tokens.pad_token_id)
        for marker in chat.markers:
            pieces = len(tokenizer(marker, add_special_tokens=False)["input_ids"])
            if pieces != 1:
                raise ValueError(f"data.tokenizer={data_cfg.tokenizer} splits {marker}, a marker of the "
                                 f"model's chat format, into {pieces} tokens; set data.tokenizer to the "
                                 f"model's own tokenizer")
    needed = _largest_written_id(tokenizer, chat) + 1
    if needed > model_cfg.language.vocab_size:
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer} writes ids up to {needed - 1} but "
                         f"model.language.vocab_size={model_cfg.language.vocab_size}; use the model's "
                         f"own tokenizer or a vocabulary of at least {needed}")


def _largest_written_id(tokenizer, chat: ChatFormat) -> int:
    """The largest id plain text or the format can write: every token but the special ones the format never
    writes. Those may lie past the embedding, as InternVL2.5's ``<video>`` (id 151674, its processor's
    attribute, past the 151,674 rows it has): a text typing one is a sample's reject (``beyond_vocabulary``),
    not the run's."""
    written = {*chat.markers, chat.document_end, *(token for token, _ in chat.vision_tokens)}
    unwritten = {token_id for token_id, added in tokenizer.added_tokens_decoder.items()
                 if added.special and added.content not in written}
    return next(token_id for token_id in range(len(tokenizer) - 1, -1, -1) if token_id not in unwritten)


def document_marker_ids(tokenizer, data_cfg: DataConfig, chat: ChatFormat) -> tuple[list[int], int]:
    """(ids opening a document: the format's ``text_start``, e.g. Llama 3's <|begin_of_text|>; the id
    of its ``document_end``, e.g. Qwen's <|endoftext|>): each must be one token of the tokenizer."""
    ids = []
    for marker in (chat.text_start, chat.document_end):
        pieces = tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
        if marker and len(pieces) != 1:
            raise ValueError(f"data.tokenizer={data_cfg.tokenizer} has no token {marker}, which the model's "
                             f"format writes around pretraining documents (it splits into {len(pieces)} "
                             "tokens); set data.tokenizer to the model's own tokenizer")
        ids.append(pieces)
    return ids[0], ids[1][0]


def _check_vision_token_ids(tokenizer, model_cfg: ModelConfig, chat: ChatFormat) -> None:
    for token, field_name in chat.vision_tokens:
        token_id, actual = getattr(model_cfg.tokens, field_name), tokenizer.convert_tokens_to_ids(token)
        if actual != token_id:
            raise ValueError(f"model.tokens.{field_name}={token_id} but the tokenizer maps {token} to {actual}")


def _check_pad_token_id(tokenizer, pad_token_id: int) -> None:
    """The tokenizer's pad token where it names one (Llama 3's <|finetune_right_pad_id|>), else
    some id of its vocabulary."""
    if tokenizer.pad_token_id is not None and pad_token_id != tokenizer.pad_token_id:
        raise ValueError(f"model.tokens.pad_token_id={pad_token_id} but the tokenizer's pad token "
                         f"{tokenizer.pad_token} is {tokenizer.pad_token_id}")
    if not 0 <= pad_token_id < len(tokenizer):
        raise ValueError(f"model.tokens.pad_token_id={pad_token_id} is outside the tokenizer's "
                         f"{len(tokenizer)} ids")
