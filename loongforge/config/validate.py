"""Every configuration check, in one place.

Two passes, each collecting all of its problems before raising one ``ConfigError``:

1. ``build_run_config``: the composed tree against the schema's shape: unknown keys (with the full
   dotted path and a did-you-mean), and types (ints, floats that also take ints, lists, Optional).
2. ``check_run_config``: rules spanning fields: allowed choices, model shapes (head_dim, M-RoPE
   sections, projector width), the parallel layout against the launch's world size, data sources
   and training numbers. It runs only when the shape is right, because a wrong type makes the
   cross-field rules misfire.

Messages are one sentence naming the key and saying what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from loongforge.config.data_sets import HELD_OUT_SET, named_sets
from loongforge.config.errors import ConfigError
from loongforge.config.layout import (
    DECODER_LAYOUT,
    LayoutRule,
    divisors,
    expert_tensor_parallel_size,
    layout_problems,
    context_sample_multiple,
    row_multiple,
    sample_multiple,
)
from loongforge.config.pipeline_layout import virtual_stages
from loongforge.config.language_parts import LAYER_TYPES, move_flat_expert_keys, qk_norm_problems
from loongforge.config.schema import CHAT_FORMATS, RunConfig
from loongforge.config.vision_parts import move_flat_vision_keys

# String fields restricted to a few values, keyed by dotted path.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.layer_backend": ("auto", "te", "flash", "varlen", "sdpa"),
    "training.precision": ("bf16", "fp32"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.fp8": ("off", "auto", "on"),
    "training.compile": ("auto", "on", "off"),
    "fp8.recipe": ("auto", "tensorwise", "rowwise", "scaled_mm"),
    "schedule.decay_style": ("cosine", "constant"),
    "data.source": ("synthetic", "files", "packed"),
    "data.read": ("auto", "global", "sharded"),
    "data.record_kind": ("auto", "conversation", "text", "alpaca", "caption"),
    "optimizer.name": ("adam", "sgd"),
    "parallel.encoder_dp": ("none", "tp", "full"),
    "parallel.context_parallel_comm": ("auto", "p2p", "all_gather", "a2a", "a2a+p2p"),
    "model.vision.norm": ("rms", "layer"),
    "model.language.rope_scaling_type": ("llama3", "dynamic"),
}

# Numbers that must be >= 1 (sizes, counts) and >= 0 (rates, intervals).
_AT_LEAST_ONE = (
    "model.vision.depth", "model.vision.hidden_size", "model.vision.intermediate_size",
    "model.vision.num_heads", "model.vision.patch_size", "model.vision.temporal_patch_size",
    "model.projector.spatial_merge_size",
    "model.language.num_layers", "model.language.hidden_size", "model.language.ffn_hidden_size",
    "model.language.num_attention_heads", "model.language.num_query_groups",
    "model.language.vocab_size", "data.seq_len", "data.min_pixels", "data.max_tiles", "data.video_max_frames",
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.context_parallel_size", "parallel.world_size", "parallel.collective_timeout_s", "training.train_steps", "training.global_batch_size",
    "training.eval_iters", "logging.log_interval",
)
_AT_LEAST_ZERO = (
    "optimizer.lr", "optimizer.min_lr", "optimizer.weight_decay", "optimizer.clip_grad",
    "schedule.warmup_steps", "checkpoint.save_interval", "data.num_workers",
    "data.synthetic_num_samples", "balance.fit_steps", "balance.fit_warmup_steps",
    "training.manual_gc_interval", "training.eval_interval", "training.loss_chunk_tokens",
    "balance.refit_interval", "balance.threshold",
)


# --------------------------------------------------------------------------------------------
# Schema introspection
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    # get_type_hints resolves the string annotations `from __future__ import annotations` leaves.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _optional_inner(type_: Any) -> Any | None:
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(type_) in (Union, types.UnionType):
        args = [arg for arg in typing.get_args(type_) if arg is not type(None)]
        if len(args) == 1 and len(typing.get_args(type_)) == 2:
            return args[0]
    return None


def _is_section(type_: Any) -> bool:
    return isinstance(type_, type) and dataclasses.is_dataclass(type_)


def _section_of(type_: Any) -> type | None:
    """The section class of a field typed as a section or an optional (nullable) section."""
    type_ = _optional_inner(type_) or type_
    return type_ if _is_section(type_) else None


def _iter_schema_paths(cls: type, prefix: str = "") -> Iterator[str]:
    for name, type_ in _field_types(cls).items():
        path = f"{prefix}{name}"
        yield path
        section = _section_of(type_)
        if section is not None:
            yield from _iter_schema_paths(section, f"{path}.")


@functools.lru_cache(maxsize=None)
def schema_paths() -> tuple[str, ...]:
    """Every dotted key of RunConfig, sections included (``model``, ``model.vision``, ...)."""
    return tuple(_iter_schema_paths(RunConfig))


def _section_type(dotted: str) -> type | None:
    cls: Any = RunConfig
    for segment in filter(None, dotted.split(".")):
        cls = _section_of(_field_types(cls).get(segment)) if _is_section(cls) else None
    return cls if _is_section(cls) else None


def is_schema_path(dotted: str) -> bool:
    return dotted in schema_paths()


def suggest_key(dotted: str) -> str | None:
    """The closest valid dotted key: a sibling first, then the same name in another section."""
    parent, _, leaf = dotted.rpartition(".")
    section = _section_type(parent)
    if section is not None:
        close = difflib.get_close_matches(leaf, list(_field_types(section)), n=1, cutoff=0.6)
        if close:
            return f"{parent}.{close[0]}" if parent else close[0]
    # A key put in the wrong section (training.lr -> optimizer.lr).
    by_leaf = {path.rpartition(".")[2]: path for path in reversed(schema_paths())}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)
    return by_leaf[close[0]] if close else None


def unknown_key_message(dotted: str) -> str:
    suggestion = suggest_key(dotted)
    if suggestion:
        return f"unknown key '{dotted}'; did you mean '{suggestion}'?"
    parent = dotted.rpartition(".")[0]
    section = _section_type(parent)
    if section is None:
        sections = ", ".join(_field_types(RunConfig))
        return f"unknown key '{dotted}'; top-level sections are: {sections}."
    where = f"under '{parent}'" if parent else "at the top level"
    return f"unknown key '{dotted}'; valid keys {where}: {', '.join(_field_types(section))}."


# --------------------------------------------------------------------------------------------
# Pass 1: tree -> RunConfig, checking keys and types
# --------------------------------------------------------------------------------------------

_TYPE_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"),
               bool: ("true or false", "booleans"), str: ("a string", "strings")}


def describe_type(type_: Any) -> str:
    inner = _optional_inner(type_)
    if inner is not None:
        return f"{describe_type(inner)} or null"
    if typing.get_origin(type_) is list:
        (item,) = typing.get_args(type_)
        return f"a list of {_TYPE_WORDS.get(item, (None, str(item)))[1]}"
    if _is_section(type_):
        return "a section of keys"
    return _TYPE_WORDS.get(type_, (str(type_),))[0]


def _describe_value(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a section", type(None): "null"}
    kind = kinds.get(type(value), type(value).__name__)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return kind if value is None or isinstance(value, dict) else f"{shown} ({kind})"


def yaml_text(value: Any) -> str:
    """How a value is written in YAML (null, true), as users type it."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def _scalar_fits(value: Any, type_: Any) -> bool:
    if typing.get_origin(type_) is list:  # a list of lists (canvas sizes, say)
        (item_type,) = typing.get_args(type_)
        return isinstance(value, list) and all(_scalar_fits(v, item_type) for v in value)
    if type_ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, type_)


# Where a dotted key was set, as "file:line", or None (a preset, an override, a default).
KeyLocator = Callable[[str], Optional[str]]


class _Builder:
    """Converts a composed tree into schema dataclasses, recording every problem it meets."""

    def __init__(self, locate: Optional[KeyLocator] = None) -> None:
        self.errors: list[str] = []
        self._locate = locate or (lambda dotted: None)

    def add_error(self, dotted: str, message: str) -> None:
        where = self._locate(dotted)
        self.errors.append(f"{where}: {message}" if where else message)

    def type_error(self, path: str, type_: Any, value: Any, default: Any) -> None:
        default_hint = "" if _is_section(type_) else f"; the default is {yaml_text(default)}"
        self.add_error(path, f"{path}: expected {describe_type(type_)}, "
                             f"got {_describe_value(value)}{default_hint}.")

    def section(self, cls: type, tree: Any, path: str) -> Any:
        default = cls()
        if not isinstance(tree, dict):
            self.type_error(path or "config", cls, tree, None)
            return default
        prefix = f"{path}." if path else ""
        types_ = _field_types(cls)
        values = {}
        for key, raw in tree.items():
            dotted = f"{prefix}{key}"
            if key not in types_:
                self.add_error(dotted, unknown_key_message(dotted))
                continue
            values[key] = self.value(types_[key], raw, dotted, getattr(default, key))
        return dataclasses.replace(default, **values)

    def value(self, type_: Any, raw: Any, path: str, default: Any,
              declared: Any = None) -> Any:
        """``raw`` converted to ``type_``; ``declared`` is the field's full type for messages."""
        declared = declared or type_
        inner = _optional_inner(type_)
        if inner is not None:
            return None if raw is None else self.value(inner, raw, path, default, declared)
        if _is_section(type_):
            return self.section(type_, raw, path)
        if typing.get_origin(type_) is list:
            (item_type,) = typing.get_args(type_)
            if not isinstance(raw, list) or not all(_scalar_fits(v, item_type) for v in raw):
                self.type_error(path, declared, raw, default)
                return default
            return [float(v) if item_type is float else v for v in raw]
        if not _scalar_fits(raw, type_):
            self.type_error(path, declared, raw, default)
            return default
        return float(raw) if type_ is float else raw


def build_run_config(tree: dict[str, Any], locate: Optional[KeyLocator] = None) -> RunConfig:
    """The RunConfig a composed tree describes; keys not in the tree keep the schema default.

    ``locate`` names the file and line a key came from, so a user's YAML mistake points there.
    """
    builder = _Builder(locate)
    cfg = builder.section(RunConfig, _with_moved_keys(tree), "")
    if builder.errors:
        raise ConfigError(builder.errors)
    return cfg


def _with_moved_keys(tree: Any) -> Any:
    """``tree`` with keys an older loongforge wrote at another place moved to today's (a copy; the caller's
    tree is left as it is), each move told on stderr in one line naming the new key."""
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
        return tree
    model = dict(tree["model"])
    notes = []
    if isinstance(model.get("language"), dict):
        model["language"] = dict(model["language"])
        notes += move_flat_expert_keys(model["language"])
    if isinstance(model.get("vision"), dict):
        model["vision"] = dict(model["vision"])
        notes += move_flat_vision_keys(model["vision"])
    for line in notes:
        print(line, file=sys.stderr)
    return {**tree, "model": model}


# --------------------------------------------------------------------------------------------
# Pass 2: rules across fields
# --------------------------------------------------------------------------------------------

def _get(cfg: Any, dotted: str) -> Any:
    return operator.attrgetter(dotted)(cfg)


def _check_choices(cfg: RunConfig) -> list[str]:
    errors = []
    for path, allowed in CHOICES.items():
        if not _present(cfg, path):
            continue
        value = _get(cfg, path)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
            hint = f" did you mean '{close[0]}'?" if close else ""
            errors.append(f"{path}='{value}' is not one of {' | '.join(allowed)};{hint} "
                          f"set {path} to one of those.")
    return errors


def _present(cfg: RunConfig, dotted: str) -> bool:
    """Whether the section holding ``dotted`` is there (a text-only model has no model.vision)."""
    return _get(cfg, dotted.rpartition(".")[0]) is not None


def _check_ranges(cfg: RunConfig) -> list[str]:
    errors = [f"{path}={_get(cfg, path)} must be at least 1." for path in _AT_LEAST_ONE
              if _present(cfg, path) and _get(cfg, path) < 1]
    errors += [f"{path}={_get(cfg, path)} must not be negative." for path in _AT_LEAST_ZERO
               if _get(cfg, path) < 0]
    exit_at_step = getattr(cfg.training, "exit_at_step", None)
    if exit_at_step is not None and exit_at_step < 1:
        errors.append(f"training.exit_at_step={exit_at_step} must be at least 1 (or null to run "
                      f"all training.train_steps).")
    vision_tp = cfg.parallel.vision_tensor_model_parallel_size
    if vision_tp is not None and vision_tp < 1:
        errors.append(f"parallel.vision_tensor_model_parallel_size={vision_tp} must be at least 1 "
                      f"(or null to follow the language TP).")
    return errors


def _check_language_shape(cfg: RunConfig) -> list[str]:
    language = cfg.model.language
    errors = []
    if language.head_dim is None and language.hidden_size % language.num_attention_heads:
        errors.append(f"model.language.hidden_size={language.hidden_size} is not divisible by "
                      f"model.language.num_attention_heads={language.num_attention_heads}; "
                      f"head_dim must be a whole number (or set model.language.head_dim).")
        return errors
    if language.num_attention_heads % language.num_query_groups:
        errors.append(f"model.language.num_attention_heads={language.num_attention_heads} is not "
                      f"divisible by model.language.num_query_groups={language.num_query_groups}; "
                      f"choose query groups from {_list(divisors(language.num_attention_heads))}.")
    head_dim = language.head_dim or language.hidden_size // language.num_attention_heads
    if language.head_dim is not None and language.head_dim < 1:
        errors.append(f"model.language.head_dim={language.head_dim} must be at least 1 (or null).")
        return errors
    rotary_channels = int(head_dim * language.partial_rotary_factor)
    if not 0 < language.partial_rotary_factor <= 1 or rotary_channels % 2:
        errors.append(f"model.language.partial_rotary_factor={language.partial_rotary_factor} must be in (0, 1] "
                      f"and rotate an even number of the head's {head_dim} channels.")
        return errors
    dynamic_rope = language.rope_scaling_factor is not None and language.rope_scaling_type == "dynamic"
    if dynamic_rope and cfg.data.seq_len > language.max_position_embeddings:
        errors.append(f"data.seq_len={cfg.data.seq_len} is past model.language.max_position_embeddings="
                      f"{language.max_position_embeddings}, where dynamic RoPE scaling would grow the base per "
                      f"length; loongforge trains plain RoPE up to it: set data.seq_len <= "
                      f"{language.max_position_embeddings}.")
    section = language.mrope_section
    if cfg.model.vision is None:
        # A text-only model: 1-D RoPE, positions from the token order.
        if section:
            errors.append(f"model.language.mrope_section={section} is for vision-language models; "
                          f"a text-only model (model.vision: null) uses 1-D RoPE: set it to [].")
    elif not section:
        pass  # a VLM with 1-D RoPE; whether the family's is checks its rule (models.registry)
    elif len(section) != 3:
        errors.append(f"model.language.mrope_section={section} must have 3 entries "
                      f"(temporal, height, width rotary pairs).")
    elif sum(section) != rotary_channels // 2:
        half = ("head_dim/2" if rotary_channels == head_dim
                else f"the rotary channels / 2 (partial_rotary_factor {language.partial_rotary_factor})")
        errors.append(f"model.language.mrope_section={section} sums to {sum(section)} but must sum "
                      f"to {half} = {rotary_channels // 2} (head_dim {head_dim}); adjust the three entries.")
    return errors


# The model fields of each layer kind or option a family may build (``ModelFamily.features``), keyed by
# their path under ``model.``, with the value that means "not built": a family that does not build a
# feature leaves its fields so (``models.registry`` names the key and the families that do build it).
MODEL_FEATURE_FIELDS: dict[str, dict[str, Any]] = {
    # hybrid layers: linear and full attention by layer, gated attention, partial rotary, (1 + w) norms
    "hybrid_layers": {"language.layer_types": [], "language.linear_attention": None,
                      "language.attention_output_gate": False, "language.zero_centered_norms": False},
    # RoPE on the first channels of each head only
    "partial_rotary": {"language.partial_rotary_factor": 1.0},
    # q/k norms over all heads at once (a weight per channel)
    "layer_qk_norm": {"language.qk_norm_type": "per_head"},
    # sliding-window layers with sinks among full ones (MiMo-V2-Flash's attention)
    "sliding_window": {"language.sliding_window": None},
    # a lightning indexer choosing each query's top-k keys for multi-latent attention (DeepSeek Sparse Attention)
    "sparse_attention": {"language.sparse_attention": None},
    # routed experts (megatron-core's MoE layer)
    "experts": {"language.moe": None},
    # a shared expert beside the routed ones
    "shared_expert": {"language.moe.shared_expert_ffn_hidden_size": None},
    # multi-latent attention, YaRN, leading dense layers and the sigmoid / grouped / biased routers
    "latent_attention": {"language.multi_latent_attention": None, "language.yarn": None,
                         "language.moe.first_dense_layers": 0, "language.moe.router_score_function": "softmax",
                         "language.moe.router_fp32": False, "language.moe.router_bias_update_rate": 0.0,
                         "language.moe.router_num_groups": None, "language.moe.router_group_topk": None,
                         "language.moe.routed_scaling_factor": 1.0, "language.moe.shared_expert_gate": True},
    # modality-isolated experts: text and vision tokens routed to expert sets of their own
    "modality_experts": {"language.moe.vision_ffn_hidden_size": None},
    # a chat format chosen by name (a text-only model's; a version's template where versions share an architecture)
    "chat_format": {"chat_format": None},
    # a decoder whose transformers architecture the run states (one family's decoder is its own)
    "text_architecture": {"language.architecture": None},
}


def unbuilt_feature_fields(cfg: RunConfig, features: frozenset[str]) -> list[tuple[str, str, Any, Any]]:
    """(feature, ``model.``-relative key, value, "not built" value) of each field set away from its "not
    built" value whose feature is not in ``features`` (what the run's family builds)."""
    found = []
    for feature, fields in MODEL_FEATURE_FIELDS.items():
        if feature in features:
            continue
        for name, default in fields.items():
            section = name.rpartition(".")[0]
            if section and _get(cfg.model, section) is None:
                continue  # its section is null: nothing of it is built
            value = _get(cfg.model, name)
            if value != default:
                found.append((feature, name, value, default))
    return found



def _check_layer_kinds(cfg: RunConfig) -> list[str]:
    """``layer_types`` names every layer's token mixer, each kind's section is given exactly when a layer is
    of that kind, and each given section's own checks (``config.language_parts``)."""
    language, key = cfg.model.language, "model.language"
    tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
    errors = []
    unknown = sorted(set(language.layer_types) - set(LAYER_TYPES))
    if unknown:
        errors.append(f"{key}.layer_types holds {unknown}; each entry must be one of {', '.join(LAYER_TYPES)}.")
    if language.layer_types and len(language.layer_types) != language.num_layers:
        errors.append(f"{key}.layer_types has {len(language.layer_types)} entries but {key}.num_layers="
                      f"{language.num_layers}; give one per layer.")
    linear = "linear_attention" in language.layer_types
    if linear and language.linear_attention is None:
        errors.append(f"{key}.layer_types names linear_attention layers but {key}.linear_attention is null; "
                      f"give its heads, head sizes and conv_kernel.")
    if not linear and language.linear_attention is not None:
        errors.append(f"{key}.linear_attention is set but no entry of {key}.layer_types is linear_attention; "
                      f"set it to null or name the linear layers.")
    if linear and language.linear_attention is not None:
        errors += language.linear_attention.problems(tensor_parallel=tp)
    if language.multi_latent_attention is not None:
        errors += language.multi_latent_attention.problems(
            num_attention_heads=language.num_attention_heads, num_query_groups=language.num_query_groups,
            tensor_parallel=tp, context_parallel=cp)
    elif language.yarn is not None:
        errors.append(f"{key}.yarn is set but {key}.multi_latent_attention is null: megatron-core applies YaRN "
                      f"in multi-latent attention only; set yarn: null.")
    if language.sparse_attention is not None:
        errors += language.sparse_attention.problems(multi_latent_attention=language.multi_latent_attention,
                                                     context_parallel=cp, lora_rank=cfg.lora.rank)
    if language.moe is not None:
        errors += language.moe.problems(num_layers=language.num_layers)
    errors += qk_norm_problems(qk_norm=language.qk_norm, qk_norm_type=language.qk_norm_type,
                               num_query_groups=language.num_query_groups, tensor_parallel=tp)
    if "sliding_attention" in language.layer_types and language.sliding_window is None:
        errors.append(f"{key}.layer_types names sliding_attention layers but {key}.sliding_window is null; give "
                      f"its size, heads and RoPE theta.")
    if language.sliding_window is not None:
        errors += language.sliding_window.problems(
            num_attention_heads=language.num_attention_heads, num_query_groups=language.num_query_groups,
            tensor_parallel=tp, context_parallel=cp, layer_types=language.layer_types)
    return errors


def _check_chat_format(cfg: RunConfig) -> list[str]:
    name = cfg.model.chat_format
    if name is not None and name not in CHAT_FORMATS:
        return [f"model.chat_format='{name}' is not one of {' | '.join(CHAT_FORMATS)}; set one of those, or null "
                f"for the architecture's own."]
    return []


def _check_vision_shape(cfg: RunConfig) -> list[str]:
    vision, projector = cfg.model.vision, cfg.model.projector
    if vision is None or projector is None:
        if vision is not projector:
            present, absent = ("vision", "projector") if projector is None else ("projector", "vision")
            return [f"model.{present} is set but model.{absent} is null; a text-only model sets both "
                    f"to null, a vision-language model neither."]
        return []
    errors = []
    if vision.hidden_size % vision.num_heads:
        errors.append(f"model.vision.hidden_size={vision.hidden_size} is not divisible by "
                      f"model.vision.num_heads={vision.num_heads}; head_dim must be a whole "
                      f"number.")
    if projector.out_hidden_size != cfg.model.language.hidden_size:
        errors.append(f"model.projector.out_hidden_size={projector.out_hidden_size} must equal "
                      f"model.language.hidden_size={cfg.model.language.hidden_size} (the merger "
                      f"writes into the text embeddings); set model.projector.out_hidden_size="
                      f"{cfg.model.language.hidden_size}.")
    if vision.window is not None:
        errors += vision.window.problems(depth=vision.depth, patch_size=vision.patch_size,
                                         spatial_merge_size=projector.spatial_merge_size)
    if vision.anyres is not None:
        errors += vision.anyres.problems(image_size=vision.image_size)
    vision_tp = cfg.parallel.vision_tensor_model_parallel_size or cfg.parallel.tensor_model_parallel_size
    language = cfg.model.language
    if vision.qk_norm and vision_tp > 1 and language.qk_norm and language.qk_norm_type == "per_head":
        errors.append(f"model.vision.qk_norm=true at vision TP {vision_tp} beside a decoder with per-head q/k norms "
                      f"(model.language.qk_norm): megatron sums every q/k norm's gradient over TP, which would mix "
                      f"the tower's TP shards; set parallel.vision_tensor_model_parallel_size=1.")
    return errors


def _list(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)


def _check_world_and_batch(cfg: RunConfig, world_size: int) -> list[str]:
    parallel, training = cfg.parallel, cfg.training
    tp, pp, cp = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.context_parallel_size)
    errors = []
    if world_size % (tp * pp * cp):
        errors.append(f"world size {world_size} is not a multiple of TP x PP x CP = {tp} x {pp} x {cp} = "
                      f"{tp * pp * cp}; launch a multiple of {tp * pp * cp} processes (--nproc-per-node or "
                      f"parallel.world_size) or lower the TP/PP/CP sizes.")
        return errors
    data_parallel = world_size // (tp * pp * cp)
    if training.global_batch_size % data_parallel:
        errors.append(f"training.global_batch_size={training.global_batch_size} is not divisible "
                      f"by the data-parallel size {data_parallel} (world {world_size} / (TP {tp} x "
                      f"PP {pp} x CP {cp})); use a multiple of {data_parallel}.")
    if parallel.sequence_parallel and tp == 1:
        errors.append("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size "
                      "> 1; turn it off or raise TP.")
    micro_batches = training.global_batch_size // data_parallel
    if virtual_stages(parallel) > 1 and pp > 1 and micro_batches % pp:
        errors.append(f"the interleaved pipeline runs micro-batches in groups of PP={pp}, but each replica has "
                      f"{micro_batches} per step (training.global_batch_size={training.global_batch_size} / "
                      f"DP {data_parallel}); use a global batch size that is a multiple of "
                      f"{pp * data_parallel} (PP x DP).")
    return errors + _check_context_parallel(cfg)


def _check_context_parallel(cfg: RunConfig) -> list[str]:
    """CP cuts every sample into 2 x CP chunks: rows must split evenly, and the sdpa / flash
    attention gathers keys and values (megatron-core's other CP communications are TE's)."""
    parallel, data = cfg.parallel, cfg.data
    cp, comm = parallel.context_parallel_size, parallel.context_parallel_comm
    errors = []
    needed = context_sample_multiple(cp)
    if data.sample_multiple is not None and (data.sample_multiple < 1 or data.sample_multiple % needed):
        errors.append(f"data.sample_multiple={data.sample_multiple} must be a positive multiple of {needed} "
                      f"(2 x parallel.context_parallel_size); set it to {needed} or leave it null.")
        return errors
    if (cp > 1 or data.sample_multiple) and data.seq_len % row_multiple(data, parallel):
        errors.append(f"data.seq_len={cfg.data.seq_len} must be a multiple of {row_multiple(data, parallel)} "
                      f"(samples padded to a multiple of {sample_multiple(data, parallel)}"
                      f"{', each CP rank share split over TP under sequence parallelism' if cp > 1 and parallel.sequence_parallel else ''}).")
    if comm not in ("auto", "all_gather") and cfg.model.layer_backend in ("sdpa", "flash", "varlen"):
        errors.append(f"parallel.context_parallel_comm={comm} is Transformer Engine's; the "
                      f"{cfg.model.layer_backend} layer backend gathers keys and values: set it to auto or "
                      f"all_gather, or model.layer_backend=te.")
    return errors


def _check_parallel_layout(cfg: RunConfig, world_size: int, layout: LayoutRule) -> list[str]:
    return (family_layout_problems(cfg, layout) + _check_world_and_batch(cfg, world_size)
            + _check_expert_layout(cfg, world_size))


def _check_expert_layout(cfg: RunConfig, world_size: int) -> list[str]:
    """How mixture-of-experts layers may be split over ranks: expert parallelism (EP) divides the
    experts among data-parallel ranks, expert TP (ETP) each expert's MLP; megatron-core cuts the
    world into PP x (ETP x EP x expert-DP) for the experts."""
    language, parallel = cfg.model.language, cfg.parallel
    ep, etp = parallel.expert_model_parallel_size, expert_tensor_parallel_size(parallel)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if ep < 1 or etp < 1:
        return [f"parallel.expert_model_parallel_size={ep} and parallel.expert_tensor_parallel_size={etp} "
                f"must be at least 1."]
    moe = language.moe
    if moe is None:
        if ep > 1 or parallel.expert_tensor_parallel_size is not None:
            return [f"parallel.expert_model_parallel_size={ep} / expert_tensor_parallel_size="
                    f"{parallel.expert_tensor_parallel_size} split experts, but model.language.moe is null "
                    f"(a dense model); remove them."]
        return []
    errors = []
    if tp > 1 and not parallel.sequence_parallel:
        # megatron-core's MoE layer raises at the first training forward otherwise.
        errors.append(f"model.language.moe.num_experts={moe.num_experts} with "
                      f"parallel.tensor_model_parallel_size={tp} needs parallel.sequence_parallel=true "
                      f"(megatron-core trains MoE layers under TP only with sequence parallelism); set it.")
    if moe.vision_ffn_hidden_size and moe.aux_loss_coeff > 0 and virtual_stages(parallel) > 1:
        # Their loss chains the routers' counts along the stages in 1F1B order (models.decoder.modality_balance).
        errors.append(f"model.language.moe.aux_loss_coeff={moe.aux_loss_coeff} with vision_ffn_hidden_size (modality-"
                      f"isolated experts) trains under plain 1F1B pipelines only, not interleaved ones; unset "
                      f"parallel.virtual_pipeline_model_parallel_size / pipeline_layout's virtual stages, or set "
                      f"aux_loss_coeff: 0.")
    if moe.num_experts % ep:
        errors.append(f"parallel.expert_model_parallel_size={ep} does not divide model.language.moe.num_experts="
                      f"{moe.num_experts}; use one of {_list(divisors(moe.num_experts))}.")
    width = moe.ffn_hidden_size
    if width and width % etp:
        errors.append(f"parallel.expert_tensor_parallel_size={etp}{' (TP)' if parallel.expert_tensor_parallel_size is None else ''} "
                      f"does not divide model.language.moe.ffn_hidden_size={width}; use one of "
                      f"{_list(divisors(width))}.")
    if world_size % pp == 0 and (world_size // pp) % (etp * ep):
        errors.append(f"world size {world_size} / PP {pp} is not a multiple of expert TP x EP = {etp} x {ep}; "
                      f"launch a multiple of {pp * etp * ep} processes or lower the expert sizes.")
    return errors


def family_layout_problems(cfg: RunConfig, layout: LayoutRule) -> list[str]:
    """What a model family's layout rule refuses in ``cfg`` (no world size involved): for checks
    above config loading, which only knows the decoder rule."""
    parallel = cfg.parallel
    return layout_problems(cfg.model, layout, tp=parallel.tensor_model_parallel_size,
                           pp=parallel.pipeline_model_parallel_size,
                           vision_tp=parallel.vision_tensor_model_parallel_size,
                           vp=parallel.virtual_pipeline_model_parallel_size,
                           pipeline_layout=parallel.pipeline_layout) + _check_encoder_dp(cfg, layout)


def _check_encoder_dp(cfg: RunConfig, layout: LayoutRule) -> list[str]:
    """Dividing the media among the ranks of a TP group (``tp``) or a model-parallel group
    (``full``) needs a whole encoder on each of them, and a family that implements the mode."""
    parallel = cfg.parallel
    if parallel.encoder_dp in CHOICES["parallel.encoder_dp"] and parallel.encoder_dp not in layout.encoder_dp_modes:
        return [f"parallel.encoder_dp={parallel.encoder_dp}: model.family={cfg.model.family} implements "
                f"{' | '.join(layout.encoder_dp_modes)}; set parallel.encoder_dp={layout.encoder_dp_modes[0]}."]
    if not layout.encoder_cp and parallel.encoder_cp and parallel.context_parallel_size > 1:
        return [f"parallel.encoder_cp=true: model.family={cfg.model.family}'s encoder packs each image by its "
                f"size and runs whole images where it is; set parallel.encoder_cp=false."]
    if parallel.encoder_full_recompute and parallel.encoder_dp != "full":
        return [f"parallel.encoder_full_recompute=true applies to parallel.encoder_dp=full (it is "
                f"{parallel.encoder_dp}); set parallel.encoder_dp=full or parallel.encoder_full_recompute=false."]
    vision_tp = parallel.vision_tensor_model_parallel_size
    inherited = vision_tp is None
    vision_tp = parallel.tensor_model_parallel_size if inherited else vision_tp
    if parallel.encoder_dp == "none" or vision_tp == 1:
        return []
    source = " (inherited from parallel.tensor_model_parallel_size)" if inherited else ""
    return [f"parallel.encoder_dp={parallel.encoder_dp} needs "
            f"parallel.vision_tensor_model_parallel_size=1, got {vision_tp}{source}; set "
            f"parallel.vision_tensor_model_parallel_size=1 or parallel.encoder_dp=none."]


def _check_data(cfg: RunConfig) -> list[str]:
    data = cfg.data
    errors = []
    if data.source == "files" and not data.paths:
        errors.append("data.source=files needs data.paths, a list of dataset files; "
                      "set data.paths=[/path/a.jsonl] or use data.source=synthetic.")
    if data.source == "packed" and not data.packed:
        errors.append("data.source=packed needs data.packed, the folder `loongforge pack` wrote; "
                      "set data.packed=/path/to/packed.")
    if data.source == "packed" and data.read == "sharded":
        errors.append("data.read=sharded does not apply to data.source=packed: the pack manifest already "
                      "gives every rank every length; use data.read=auto.")
    if data.streaming and data.source != "files":
        errors.append(f"data.streaming=true reads data.paths; it does not apply to data.source={data.source}; "
                      "set data.source=files or data.streaming=false.")
    if data.accept_changed_files and data.source != "files":
        errors.append(f"data.accept_changed_files=true resumes past changed data.paths files; it does not apply "
                      f"to data.source={data.source}; set data.source=files or data.accept_changed_files=false.")
    if data.shuffle_window < 1:
        errors.append(f"data.shuffle_window={data.shuffle_window} must be >= 1 (records per shuffled window).")
    if data.vision_embeddings is not None:
        errors += _check_vision_embeddings(cfg)
    errors += _check_validation(cfg) + _check_frozen_parts(cfg) + _check_weights_only(cfg)
    if data.min_pixels > data.max_pixels:
        errors.append(f"data.min_pixels={data.min_pixels} is larger than "
                      f"data.max_pixels={data.max_pixels}; lower min_pixels or raise max_pixels.")
    if data.video_min_pixels > data.video_max_pixels:
        errors.append(f"data.video_min_pixels={data.video_min_pixels} is larger than "
                      f"data.video_max_pixels={data.video_max_pixels}; swap or adjust them.")
    return errors


def _check_frozen_parts(cfg: RunConfig) -> list[str]:
    """``training.freeze_language`` leaves the encoder's parts to train: there must be one left, and
    LoRA (which freezes the whole base already) chooses what trains by ``lora.targets``."""
    training = cfg.training
    if not training.freeze_language:
        return []
    if cfg.lora.rank:
        return ["training.freeze_language=true with lora.rank > 0: LoRA freezes the whole base already; choose the "
                "adapted parts with lora.targets (e.g. [projector]) and set training.freeze_language=false."]
    if cfg.model.vision is None or (training.freeze_vision and training.freeze_projector):
        what = ("a text-only model has nothing else" if cfg.model.vision is None
                else "with training.freeze_vision and freeze_projector nothing is left")
        return [f"training.freeze_language=true leaves nothing to train ({what}); set it to false."]
    return []


def _check_weights_only(cfg: RunConfig) -> list[str]:
    checkpoint = cfg.checkpoint
    if not checkpoint.weights_only:
        return []
    if checkpoint.load is None:
        return ["checkpoint.weights_only=true starts a new stage from checkpoint.load's weights; set "
                "checkpoint.load=<the earlier run's step_N folder>."]
    if cfg.lora.rank:
        return ["checkpoint.weights_only=true with lora.rank > 0: a LoRA stage takes its frozen base from "
                "checkpoint.load_hf; export the earlier run (loongforge convert CKPT DIR --to hf) and set "
                "checkpoint.load_hf=DIR instead of checkpoint.load."]
    return []


def _check_validation(cfg: RunConfig) -> list[str]:
    """Validation sets and their schedule (``train.validation``)."""
    data, training = cfg.data, cfg.training
    errors = []
    if not 0 <= data.valid_fraction < 1:
        errors.append(f"data.valid_fraction={data.valid_fraction} must be in [0, 1): the share of the training "
                      f"samples held out (e.g. 0.05), 0 for none.")
    elif data.valid_fraction and (data.source == "packed" or data.streaming):
        what = "data.source=packed (rows, not samples)" if data.source == "packed" else "data.streaming=true"
        errors.append(f"data.valid_fraction holds samples out by their index, which {what} has none of; "
                      f"name validation files in data.valid_paths instead.")
    names = [entry.partition("=")[0] for entry in data.valid_paths if "=" in entry]
    if any(not name.strip() for name in names):
        errors.append(f"data.valid_paths={list(data.valid_paths)}: an entry \"=path\" has no set name; write "
                      f"\"name=path\" or the path alone.")
    if data.valid_fraction and HELD_OUT_SET in named_sets(list(data.valid_paths)):
        errors.append(f"data.valid_paths names a set \"{HELD_OUT_SET}\", the name of data.valid_fraction's held-out "
                      f"set; give it another name (name=path).")
    evaluates = bool(data.valid_paths or data.valid_fraction)
    if not evaluates and (training.eval_interval or training.eval_at_start):
        key = "training.eval_interval" if training.eval_interval else "training.eval_at_start"
        errors.append(f"{key} evaluates validation sets, and there are none: set data.valid_paths=[name=path] "
                      f"or data.valid_fraction (e.g. 0.05).")
    return errors


def _check_vision_embeddings(cfg: RunConfig) -> list[str]:
    """Stored embeddings replace the encoder: the samples must be ones `loongforge encode` read,
    and there is no encoder left to divide among ranks."""
    errors = []
    if cfg.data.source == "synthetic":
        errors.append("data.vision_embeddings needs data.source=files or packed (the inputs `loongforge encode` "
                      "read); synthetic samples have no stored embeddings.")
    if cfg.parallel.encoder_dp != "none":
        errors.append(f"data.vision_embeddings runs no encoder, so parallel.encoder_dp={cfg.parallel.encoder_dp} "
                      f"has nothing to divide; set parallel.encoder_dp=none.")
    if not Path(cfg.data.vision_embeddings).is_dir():
        errors.append(f"data.vision_embeddings={cfg.data.vision_embeddings} is not a folder; pass the --output "
                      f"folder of `loongforge encode`.")
    return errors


def _check_balance(cfg: RunConfig) -> list[str]:
    balance = cfg.balance
    if balance.cost_model is not None and not Path(balance.cost_model).is_file():
        return [f"balance.cost_model={balance.cost_model} is not a file; pass a COST.json written "
                f"by `loongforge fit-cost`, or null to fit online."]
    if balance.threshold != balance.threshold or balance.threshold == float("inf"):
        # NaN would never compare below (always re-plan) and inf would never re-plan: both typos.
        return [f"balance.threshold={balance.threshold} must be a finite number >= 0 (e.g. 0.01)."]
    if balance.refit_interval and not balance.fit_steps:
        return [f"balance.refit_interval={balance.refit_interval} needs balance.fit_steps > 0 "
                f"(the window each refit uses)."]
    return []


def _check_fp8(cfg: RunConfig) -> list[str]:
    """FP8 replaces bf16 GEMMs on a GPU; the policy file belongs to ``auto``."""
    mode, errors = cfg.training.fp8, []
    if mode not in CHOICES["training.fp8"]:
        return []  # the choice check names it
    if mode != "off" and cfg.training.precision != "bf16":
        errors.append(f"training.fp8={mode} needs training.precision=bf16 (FP8 GEMMs replace bf16 ones); "
                      f"set training.precision=bf16 or training.fp8=off.")
    if mode == "on" and cfg.training.device == "cpu":
        errors.append("training.fp8=on needs a CUDA GPU with FP8 GEMMs (compute capability 8.9+) and this run "
                      "is on the CPU (training.device=cpu); set training.fp8=off (or auto, which falls back to bf16).")
    if cfg.fp8.policy is not None and mode != "auto":
        errors.append(f"fp8.policy={cfg.fp8.policy} is read only with training.fp8=auto (it is {mode}); set "
                      f"training.fp8=auto or fp8.policy: null.")
    elif cfg.fp8.policy is not None and not Path(cfg.fp8.policy).is_file():
        errors.append(f"fp8.policy={cfg.fp8.policy} is not a file; pass the policy `loongforge bench gemm` wrote.")
    return errors


# LoRA (models.layers.lora): the towers and the block linears adapters go on.
LORA_TARGETS = ("language", "vision", "projector")
LORA_MODULES = ("qkv", "proj", "fc1", "fc2")
# Adapters wrap megatron-core's own column/row-parallel linears; Transformer Engine's are other
# classes with their own GEMM path, which loongforge does not adapt.
LORA_TE_REFUSAL = ("lora.rank > 0 adapts megatron-core's local linears and this run's model.layer_backend "
                   "is (or resolves to) te, Transformer Engine's; set model.layer_backend=flash (or sdpa).")


def _check_lora(cfg: RunConfig) -> list[str]:
    """``lora.*``: a rank of 0 switches LoRA off (the rest is then not checked); the lists name
    known towers and linears; experts only in a model with experts, each expert whole on a rank."""
    lora = cfg.lora
    if lora.rank < 0:
        return [f"lora.rank={lora.rank} must not be negative (0: no adapters; 8-64 is usual)."]
    if lora.rank == 0:
        return []
    errors = []
    if not lora.alpha > 0:
        errors.append(f"lora.alpha={lora.alpha} must be positive (the update is scaled by alpha / rank); "
                      f"set e.g. lora.alpha={2 * lora.rank}.")
    if not 0 <= lora.dropout < 1:
        errors.append(f"lora.dropout={lora.dropout} must be in [0, 1); set e.g. lora.dropout=0.05.")
    errors += _check_names("lora.targets", lora.targets, LORA_TARGETS)
    errors += _check_names("lora.modules", lora.modules, LORA_MODULES)
    if cfg.model.vision is None and set(lora.targets) & {"vision", "projector"}:
        errors.append(f"lora.targets={lora.targets} names a vision tower or projector, but this model is "
                      f"text-only (model.vision: null); set lora.targets=[language].")
    if cfg.model.layer_backend == "te":
        errors.append(LORA_TE_REFUSAL)
    if cfg.checkpoint.save_hf and not cfg.checkpoint.load_hf:
        # The HF export merges the adapters into the base, and a random base is kept in no file.
        errors.append("checkpoint.save_hf=true with lora.rank > 0 merges the adapters into the base from "
                      "checkpoint.load_hf, and this run has none (a random base); set checkpoint.load_hf=BASE_HF_FOLDER "
                      "or checkpoint.save_hf=false.")
    if cfg.data.vision_embeddings is not None and set(lora.targets) & {"vision", "projector"}:
        errors.append(f"lora.targets={lora.targets} adapts the vision tower or projector, but "
                      f"data.vision_embeddings runs neither (stored embeddings); set lora.targets=[language].")
    if lora.experts:
        errors += _check_lora_experts(cfg)
    return errors


def _check_names(key: str, values: list[str], allowed: tuple[str, ...]) -> list[str]:
    unknown = [value for value in values if value not in allowed]
    if unknown or not values:
        return [f"{key}={values} must be a non-empty list from {' | '.join(allowed)}; "
                f"{'remove ' + ', '.join(unknown) if unknown else 'name at least one'}."]
    return []


def _check_lora_experts(cfg: RunConfig) -> list[str]:
    """An expert's linears take no tensor-parallel communication of their own (the token dispatcher
    does it), so adapters on them are built only where each expert sits whole on one rank."""
    if cfg.model.language.moe is None:
        return ["lora.experts=true adapts mixture-of-experts layers, but model.language.moe is null "
                "(a dense model); set lora.experts=false."]
    etp = expert_tensor_parallel_size(cfg.parallel)
    if etp != 1:
        return [f"lora.experts=true needs each expert whole on a rank, but the expert TP size is {etp}; "
                f"set parallel.expert_tensor_parallel_size=1 or lora.experts=false."]
    return []


# What preference training runs with so far: one process of a text model, reading data.paths whole.
# The layouts, LoRA's reference (the base with adapters off), streaming, balancing, validation sets,
# vision-language pairs and MoE / MTP models are issue 55's next parts; each is refused here naming the setting that runs.
_PREFERENCE_SETTINGS = (
    (lambda cfg: cfg.lora.rank == 0, "lora.rank > 0", "set lora.rank=0"),
    (lambda cfg: not cfg.data.streaming, "data.streaming=true", "set data.streaming=false"),
    (lambda cfg: not cfg.balance.enabled, "balance.enabled=true", "set balance.enabled=false"),
    (lambda cfg: not cfg.data.valid_paths and not cfg.data.valid_fraction, "validation sets",
     "set data.valid_paths=[] and data.valid_fraction=0"),
    (lambda cfg: cfg.model.vision is None, "a vision tower", "choose a text model's preset (model.vision: null)"),
    # The router's balance loss and MTP's losses are weighted by the SFT step's token counts (train.step).
    (lambda cfg: cfg.model.language.moe is None, "mixture-of-experts layers",
     "choose a dense model's preset (model.language.moe: null)"),
    (lambda cfg: cfg.model.language.mtp_num_layers == 0, "multi-token prediction", "set model.language.mtp_num_layers=0"),
)


def _check_preference(cfg: RunConfig, world_size: int) -> list[str]:
    """``preference.*`` (``config.preference``): the section's own checks, pairs to read, and the
    settings preference training runs with (``_PREFERENCE_SETTINGS``)."""
    preference = cfg.preference
    if preference is None:
        return []
    errors = preference.problems()
    if cfg.data.source != "files":
        errors.append(f"preference.loss={preference.loss} trains on chosen/rejected pairs read from data.paths, and "
                      f"data.source={cfg.data.source} has none; set data.source=files and data.paths=[pairs.json].")
    if world_size != 1:
        errors.append(f"preference.loss={preference.loss} trains at one process, and this launch has {world_size}; "
                      f"launch one process (parallel.world_size=1).")
    errors += [f"preference.loss={preference.loss} does not train with {what} yet; {fix}."
               for holds, what, fix in _PREFERENCE_SETTINGS if not holds(cfg)]
    return errors


def _check_optimizer(cfg: RunConfig) -> list[str]:
    optimizer, parallel = cfg.optimizer, cfg.parallel
    errors = []
    if optimizer.min_lr > optimizer.lr:
        errors.append(f"optimizer.min_lr={optimizer.min_lr} is above optimizer.lr={optimizer.lr}; "
                      f"the schedule decays from lr to min_lr, so set min_lr <= lr.")
    if parallel.overlap_param_gather and parallel.use_distributed_optimizer is False:
        errors.append("parallel.overlap_param_gather=true overlaps the distributed optimizer's all-gather of "
                      "the updated weights, but parallel.use_distributed_optimizer=false; leave "
                      "overlap_param_gather unset (null) or turn the distributed optimizer on.")
    return errors


def check_run_config(cfg: RunConfig, world_size: int | None = None,
                     layout: LayoutRule = DECODER_LAYOUT) -> list[str]:
    """Every cross-field problem of ``cfg``; ``world_size`` comes from the launch.

    Without a launch (dry runs, tests) the world size is ``cfg.parallel.world_size``. ``layout``
    is the model family's rule (``ModelFamily.layout``); config loading, below the model
    families, checks the decoder rule every family starts from.
    """
    world = cfg.parallel.world_size if world_size is None else world_size
    errors = _check_choices(cfg)
    range_errors = _check_ranges(cfg)
    if range_errors:
        # Zero or negative sizes would make the divisibility checks below divide by zero.
        return errors + range_errors
    errors += (_check_language_shape(cfg) + _check_layer_kinds(cfg) + _check_chat_format(cfg)
               + _check_vision_shape(cfg))
    errors += _check_parallel_layout(cfg, world, layout)
    return (errors + _check_data(cfg) + _check_optimizer(cfg) + _check_balance(cfg) + _check_fp8(cfg)
            + _check_lora(cfg) + _check_preference(cfg, world))


def validate(cfg: RunConfig, world_size: int | None = None,
             layout: LayoutRule = DECODER_LAYOUT) -> RunConfig:
    """``cfg`` unchanged if every rule holds for a launch of ``world_size``; else ConfigError."""
    errors = check_run_config(cfg, world_size, layout)
    if errors:
        raise ConfigError(errors)
    return cfg


validate_run_config = validate


def validate_tree(tree: dict[str, Any], world_size: int | None = None,
                  locate: Optional[KeyLocator] = None) -> RunConfig:
    """Build and check: the one entry point from a composed tree to a valid RunConfig."""
    return validate(build_run_config(tree, locate), world_size)
