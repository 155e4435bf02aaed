"""The model-family contract: everything the rest of loongforge needs from a family, in one object.

A family folder (``loongforge/models/<name>/``) exports one ``ModelFamily`` as ``FAMILY``;
``loongforge.models.registry`` maps ``model.family`` to it, and nothing else imports the folder.
Training builds the model through ``build`` (``loongforge encode`` the encoder alone through
``build_encoder``), ``loongforge convert`` reads and writes HF checkpoints
through the HF fields, the data pipeline and the profile sweep compute rotary positions through
``position_ids``, the dry-run plan counts parameters through ``count_parameters``, MFU counts a
step's model FLOPs through ``training_flops``, tokenizing and
chat rendering use the format ``chat`` gives for the run's model, every layout check asks
``layout``, ``loongforge convert --check-logits`` loads its reference through ``hf_model_class``, and
every HF export writes the processor files ``hf_processor_files`` gives (``convert.serving``).

Fields are plain values and functions so that a family is data: a test walks every registered
family and checks each field is there and callable where it should be.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Optional

from loongforge.config.errors import ConfigError
from loongforge.config.layout import LayoutRule
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.flops import StepFlops
from loongforge.models.media import ImageProcessing, VideoProcessing
from loongforge.models.decoder.vocab import padded_vocab_size

if TYPE_CHECKING:  # the contract is read by torch-free code (pack planning, the dry-run plan)
    import torch

    from loongforge.models.hf.rules import Rule

# (input_ids [L], image_grid_thw [n, 3] | None, video_grid_thw [m, 3] | None,
#  second_per_grid_ts [m] | None) -> rotary position ids [3, L] of one sample.
PositionIds = Callable[["torch.Tensor", Optional["torch.Tensor"], Optional["torch.Tensor"], Optional[list]],
                       "torch.Tensor"]


@dataclass(frozen=True)
class LazyFunction:
    """A function named by ``"module:function"``, imported at its first call (and picklable as its
    name: a spawned process imports it there, not the process that pickled it).

    A family's ``build`` imports megatron-core (seconds); looking a family up for its parameter
    count or its HF facts should not, nor should a launcher that only starts the workers."""

    path: str

    @property
    def __name__(self) -> str:  # the function's, for whoever reports a callable by name
        return self.path.partition(":")[2]

    def resolve(self) -> Callable:
        module_name, _, function_name = self.path.partition(":")
        return getattr(importlib.import_module(module_name), function_name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


# ``ModelFamily.vision_part`` of a family composed of whichever tower the run names (``model.vision.arch``).
ANY_TOWER = "*"

# Qwen3's reasoning tags (``ChatFormat.thinking``); one token each in its tokenizer.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# ``ChatFormat.reasoning_turns``: which assistant turns a thinking format writes its reasoning block in.
REASONING_TURNS = ("last", "after_last_user", "all", "some_after_last_user")


@dataclass(frozen=True)
class ChatFormat:
    """How a model's processor turns a conversation into text (the data side's model facts).

    ``data.template`` renders ``text_start`` once, then each turn as
    ``turn_start + role + role_end + text + turn_end + turn_sep``, with each media placeholder
    replaced by its block; the pad token inside a block is expanded to the media item's token count
    after tokenizing (ids in ``model.tokens``). The defaults are ChatML's."""

    turn_start: str
    turn_end: str
    jinja_template: str  # the same format for ``tokenizer.apply_chat_template``
    image_block: str = ""  # one image in the text, holding a single image pad token ("": no images)
    video_block: str = ""  # one video in the text, holding a single video pad token ("": no videos)
    role_end: str = "\n"  # between the role name and the text
    turn_sep: str = "\n"  # after each turn's ``turn_end``
    text_start: str = ""  # before the first turn
    # True: ``video_block`` is a bare video pad that becomes, per temporal patch, ``<{t:.1f} seconds>``
    # text + vision_start + that patch's pads + vision_end (Qwen3-VL's processor; ``data.video_tokens``).
    # False: the pad inside ``video_block`` becomes one run of the whole video's pads (Qwen2.5-VL).
    timestamped_video_frames: bool = False
    # The processor's video rule: frame sampling, sizing and patch rows (``models.media``); None: the
    # processor takes no videos (``video_block`` is "").
    video_rule: Optional[VideoProcessing] = None
    # The system turn the model's own template writes when a conversation has none (None: none);
    # ``data.system_prompt`` overrides it.
    default_system_prompt: Optional[str] = None
    # Qwen3's hybrid-thinking template: an assistant turn after the last user turn opens with its
    # reasoning in THINK_OPEN ... THINK_CLOSE (empty in the conversation's last turn when the data has
    # none); earlier assistant turns are written without theirs.
    thinking: bool = False
    # Which assistant turns of a thinking format write the block (``REASONING_TURNS``): "last" as above
    # (Qwen3); "after_last_user": every one after the last user turn, empty or not (Qwen3.5 / 3.6);
    # "all": every one (Qwen3.8, whose template preserves the reasoning of earlier turns by default);
    # "some_after_last_user": those after the last user turn that have reasoning, none written empty, an answer
    # split from its reasoning stripped of newlines at both ends (MiniMax-M2).
    reasoning_turns: str = "last"
    # Written at the head of the system turn, before the system text after a blank line, in a system
    # turn of its own where the conversation has none (Qwen3.8's reasoning-effort sentence). Set (even to "":
    # Qwen3.8 at medium effort), the template builds the system turn from the two and writes none when both
    # are empty; None: the conversation's system turn is written as it is.
    system_preamble: Optional[str] = None
    # True: each turn's text and reasoning are stripped of surrounding whitespace (Qwen3.6's ``trim``; Llama 2's
    # template strips every message).
    strips_turns: bool = False
    # Ends each pretraining document (``text`` records: no chat template, loss on every token), the
    # token base models are trained to write at a document's end. ``text_start`` opens it.
    document_end: str = "<|endoftext|>"
    # The tokenizer's vision tokens and the ``model.tokens`` field each must equal (checked before a
    # run tokenizes anything: a mismatch would put features on the wrong ids).
    vision_tokens: tuple[tuple[str, str], ...] = (
        ("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id"),
        ("<|vision_start|>", "vision_start_token_id"), ("<|vision_end|>", "vision_end_token_id"))
    # True: the processor writes each image as vision_start + its pads + vision_end around the single pad
    # of ``image_block`` (InternVL: ``<img>`` ... ``</img>``); False: the block's own markers stand.
    wraps_images: bool = False
    # True: a turn is written as its images' blocks, then its videos', then each piece of its text after a
    # newline, wherever the data placed them (LLaVA-OneVision's template); False: blocks where they stand.
    media_first: bool = False
    # Written before each image's block, ``{index}`` its 1-based count in the conversation (ERNIE-4.5-VL's
    # ``Picture {index}:``); "": none.
    image_label: str = ""
    # Formats that mark each role by a token of its own (DeepSeek's ``<｜User｜>``): (role, header) pairs
    # written in place of ``turn_start + role + role_end``, and (role, end) pairs in place of ``turn_end``
    # (DeepSeek ends only the assistant's turns).
    role_headers: tuple[tuple[str, str], ...] = ()
    role_turn_ends: tuple[tuple[str, str], ...] = ()
    # (previous role, role, header): the header of a turn of ``role`` right after a turn of ``previous role``,
    # in place of ``header(role)`` (Llama 2 writes its system prompt inside the first user turn's [INST]).
    headers_after: tuple[tuple[str, str, str], ...] = ()
    # The format's pieces that are special tokens, where its headers are plain text (Llama 2's ``[INST]``);
    # empty: ``text_start``, ``turn_start``, ``turn_end`` and ``role_headers`` (see ``markers``).
    special_tokens: tuple[str, ...] = ()

    def __post_init__(self):
        if self.video_block and self.video_rule is None:
            raise ValueError("a chat format that writes videos (video_block) needs its processor's video_rule")
        if self.reasoning_turns not in REASONING_TURNS:
            raise ValueError(f"reasoning_turns={self.reasoning_turns!r} is not one of {', '.join(REASONING_TURNS)}")

    def header(self, role: str, previous: str = "") -> str:
        """What opens a turn of ``role`` after a turn of ``previous`` ("": the first turn)."""
        for after, this, header in self.headers_after:
            if (after, this) == (previous, role):
                return header
        return dict(self.role_headers).get(role, f"{self.turn_start}{role}{self.role_end}")

    def end(self, role: str) -> str:
        """What closes a turn of ``role``."""
        return dict(self.role_turn_ends).get(role, self.turn_end)

    @property
    def markers(self) -> tuple[str, ...]:
        """The format's own text pieces that must each be one (special) token of the tokenizer."""
        if self.special_tokens:
            return self.special_tokens
        tags = (THINK_OPEN, THINK_CLOSE) if self.thinking else ()
        headers = tuple(header for _, header in self.role_headers)
        return tuple(dict.fromkeys(marker for marker in (self.text_start, self.turn_start, self.turn_end, *headers, *tags)
                                   if marker))


def text_model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    """``ModelFamily.hf_model_inputs`` of a text-only family: the token ids."""
    return {"input_ids": inputs["input_ids"]}


@dataclass(frozen=True)
class ModelFamily:
    """One model family. ``model_cfg`` below is the run's ``ModelConfig`` (``cfg.model``)."""

    name: str  # the ``model.family`` value that selects it
    hf_architectures: tuple[str, ...]  # config.json ``architectures`` entries it reads
    hf_model_types: tuple[str, ...]  # config.json ``model_type`` values it reads
    # (HF config.json dict, where it came from for errors) -> ModelConfig
    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig]
    # (ModelConfig, dtype name) -> a Hub-style config.json dict
    config_to_hf: Callable[..., dict]
    # ModelConfig -> Hub-style HF tensor name -> shape
    hf_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    # ModelConfig -> the weight map's rows (``loongforge.models.hf.rules``), their HF keys in the Hub style
    hf_rules: Callable[[ModelConfig], list[Rule]]
    # {HF key: tensor} in any key style the family reads -> the Hub style it writes. The Hub style is the
    # names the pinned transformers' ``save_pretrained`` writes (its checkpoint conversion mapping writes the
    # Hub's names back, whatever its modules are called), so that HF -> megatron -> HF gives back the files
    # read; transformers' module names (its state dict) are among the styles read.
    to_hub_style: Callable[[Mapping[str, Any]], dict]
    # (model_cfg, parallel_cfg, *, params_dtype, pre_process, post_process, device, ...) -> this
    # rank's pipeline stage; collective, needs megatron's parallel state
    build: Callable[..., "torch.nn.Module"]
    # (model_cfg, *, params_dtype, device, init_seed, group=None) -> the vision encoder alone (tower
    # + merger, the training model's parameter names and initial weights): (pixels, grid_thw) ->
    # features [P / merge_unit, LM hidden]; its layers run on ``group`` (a group of this rank alone),
    # else on megatron's groups, which must then be TP = PP = 1. None: no encoder to run on its
    # own (a text-only family; Qwen3-VL, whose DeepStack features are not stored yet).
    build_encoder: Optional[Callable[..., "torch.nn.Module"]]
    # ModelConfig -> {"vision_model", "projector", "language_model", "total", "active",
    # "routed_experts"} parameter counts; "active": what one token runs through (the total, unless
    # the layers route to experts); "routed_experts": the experts of every MoE layer (0 if dense)
    count_parameters: Callable[[ModelConfig], dict[str, int]]
    # (model_cfg, samples: Sequence[SampleCost], options: FlopOptions = FlopOptions()) -> StepFlops:
    # the model FLOPs of one training micro-batch, the samples packed in one row, by part
    # (``models.flops`` gives the convention); a sample's images/videos must carry their ``grids``
    # (else ValueError). Torch-free: MFU and plans count without building a model.
    training_flops: Callable[..., StepFlops]
    # ModelConfig -> the per-sample rotary position function (picklable)
    position_ids: Callable[[ModelConfig], PositionIds]
    # ModelConfig -> the chat format of that model (a family's architectures may differ in it)
    chat: Callable[[ModelConfig], ChatFormat]
    layout: LayoutRule
    # The transformers class (a name in ``transformers``) that loads this family's HF folders: the
    # reference ``convert --check-logits`` compares the family's model with (its forward inputs:
    # ``hf_model_inputs``). None: a composition no transformers class describes (no HF folder).
    hf_model_class: Optional[str]
    # The CPU-sized preset that exercises this family (tests walk every family through it).
    tiny_preset: str
    # (model_cfg, data_cfg) -> the processor files of a served HF folder besides the tokenizer's,
    # file name -> JSON object: the image and video processors at the run's data settings (sizes,
    # patch geometry, frame sampling) as transformers reads them; {} for a text-only family
    # (``no_processor_files``), which serves with its tokenizer alone.
    hf_processor_files: Callable[[ModelConfig, DataConfig], dict[str, dict]]
    # (vocab_size, TP size) -> rows of the embedding and output layer (what the decoder is built with)
    padded_vocab_size: Callable[[int, int], int] = padded_vocab_size
    # The vision tower it is composed of (a ``model.vision.arch`` of ``models.parts``); ANY_TOWER: the
    # one the run names; None: a text-only family.
    vision_part: Optional[str] = None
    # (model_cfg, data_cfg) -> the VLM's image processor at the run's settings (``models.media``): what
    # turns an image into patch rows and placeholders; None: its tower's (``models.parts.image_processing``).
    image_processing: Optional[Callable[[ModelConfig, DataConfig], ImageProcessing]] = None
    # (model_cfg, a collated micro-batch's model inputs: input_ids and ``media``, a MediaBatch) -> the keyword
    # inputs of ``hf_model_class``'s forward, the media as its processor gives them (``convert
    # --check-logits``); default: the ids alone (a text-only family).
    hf_model_inputs: Callable[[ModelConfig, dict], dict] = text_model_inputs
    # Prefixes of HF tensors the family's published checkpoints hold that this model has no place for
    # (Qwen3.5's multi-token-prediction head, ``mtp.``): not read on import, their count noted, never an
    # error; transformers' own class skips them too.
    hf_unread: tuple[str, ...] = ()
    # (model_cfg read from a folder's config.json, the tensor names the folder holds) -> the model the folder's
    # weights describe: where a config names parts a writer leaves out (transformers writes DeepSeek-V3's
    # ``num_nextn_predict_layers: 1`` but no multi-token-prediction layer), the parts the tensors hold.
    config_for_tensors: Callable[[ModelConfig, Collection[str]], ModelConfig] = lambda model_cfg, keys: model_cfg
    # The decoder's rotary positions: "mrope" (Qwen-VL's three sections, ``model.language.mrope_section``)
    # or "rope" (1-D: text, and VLMs that number image tokens as text; ``mrope_section`` empty); None:
    # the run's (M-RoPE where it gives ``mrope_section``).
    rope: Optional[str] = "rope"
    # The layer kinds and options beyond a dense GQA decoder that its models build: names of
    # ``config.validate.MODEL_FEATURE_FIELDS`` ("experts", "shared_expert", "hybrid_layers", "partial_rotary",
    # "layer_qk_norm", "latent_attention", "chat_format", "text_architecture"). A run that sets another
    # feature's fields is refused, naming the key and the families that build it.
    features: frozenset[str] = frozenset()
    # ModelConfig -> one-line problems (key, value and fix) of what this family's models cannot be, beyond
    # the shared checks (a router transformers' class always renormalises, say)
    config_problems: Callable[[ModelConfig], list[str]] = lambda model_cfg: []
    # ModelConfig -> the offline tokenizer (a ``data.tokenizer`` name) of that model, what ``convert
    # --check-logits`` tokenizes with when a folder ships none; None: the tiny preset's. A family whose
    # versions differ in their tokens says which a config is (InternVL2.5's <IMG_CONTEXT> 151667, 3.5's 151671).
    offline_tokenizer: Optional[Callable[[ModelConfig], str]] = None

    @property
    def has_vision(self) -> bool:
        """Whether its models see images and videos (a vision tower; ``model.vision`` is set)."""
        return self.vision_part is not None

    def tower(self, model_cfg: ModelConfig) -> str:
        """The vision tower a run of this family is built with (``models.parts``)."""
        return model_cfg.vision.arch if self.vision_part == ANY_TOWER else self.vision_part

    def reads_hf_config(self, hf_config: Mapping[str, Any]) -> bool:
        """Whether an HF config.json names this family, by an architecture or by its model_type."""
        architectures = hf_config.get("architectures") or []
        return (any(name in self.hf_architectures for name in architectures)
                or hf_config.get("model_type") in self.hf_model_types)


def hf_facts(hf_config: ModuleType) -> dict[str, Any]:
    """The ``ModelFamily`` fields a family's ``hf_config`` module gives under its conventional names
    (``NAME``, ``HF_ARCHITECTURES``, ``HF_MODEL_TYPES``, ``model_config_from_hf``,
    ``hf_config_from_model``, ``expected_hf_shapes``)."""
    return dict(name=hf_config.NAME, hf_architectures=hf_config.HF_ARCHITECTURES,
                hf_model_types=hf_config.HF_MODEL_TYPES, config_from_hf=hf_config.model_config_from_hf,
                config_to_hf=hf_config.hf_config_from_model, hf_shapes=hf_config.expected_hf_shapes)


def registered(table: Mapping[str, str], name: str, key: str, describe: Callable[[str], str]) -> ModuleType:
    """The module ``table`` registers ``name`` under (imported when first asked for); a one-line
    ConfigError naming ``key``, what it may be (``describe(choices)``) and the nearest name if unknown."""
    if not name:
        raise ConfigError(f"{key} is not set; set it to one of {' | '.join(sorted(table))}.")
    if name not in table:
        close = difflib.get_close_matches(str(name), sorted(table), n=1, cutoff=0.5)
        hint = f" did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{key}='{name}' is not {describe(' | '.join(sorted(table)))};{hint} "
                          f"set {key} to one of those.")
    return importlib.import_module(table[name])


def no_processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    """``ModelFamily.hf_processor_files`` of a text-only family: its tokenizer is its whole processor."""
    return {}
