"""What makes an exported HF folder ready to serve besides config.json and the weights: the
tokenizer and its chat template, the image and video processors, the generation defaults.

Each group of files (``families.TOKENIZER_FILES``, ``PROCESSOR_FILES``, ``GENERATION_FILE``) is
copied whole from the HF folder the run or the conversion started from when that folder has it,
and written otherwise:

- tokenizer: the one loongforge trains with (``data.tokenizer``), carrying the chat template
  loongforge renders (``ChatFormat.jinja_template``), saved by transformers (tokenizer.json,
  tokenizer_config.json, chat_template.jinja: where transformers 5 reads a template from, for the
  tokenizer and the processor alike);
- processor: the family's files at the run's data settings (``ModelFamily.hf_processor_files``);
- generation: defaults that stop at the end of a turn (the chat format's ``turn_end``).

A copied processor is checked against the run's data settings: each setting that differs is one
line of the report, and the export goes on with the copy (the folder then serves as its source
did, not as the run trained; the line says so).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.convert.families import GENERATION_FILE, PROCESSOR_FILES, TOKENIZER_FILES
from loongforge.data.measure import check_token_ids
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.registry import get_family

if TYPE_CHECKING:
    from transformers import GenerationConfig

# Before transformers 5 a processor's parts were saved to files of their own; a Hub folder may
# still hold them instead of (or beside) processor_config.json's sections.
_SECTION_FILES = {"image_processor": "preprocessor_config.json", "video_processor": "video_preprocessor_config.json"}
# Older names of the pixel bounds (Qwen2-VL's preprocessor_config.json) -> the key they set.
_KEY_ALIASES = {"min_pixels": "size.shortest_edge", "max_pixels": "size.longest_edge"}


@dataclass
class ServingFiles:
    """What an export did with each group of files."""

    copied: list[str] = field(default_factory=list)  # group names: tokenizer, processor, generation
    written: list[str] = field(default_factory=list)
    # One line per setting of a copied processor that differs from the run's, and one per group
    # that could not be written; the export goes on either way.
    warnings: list[str] = field(default_factory=list)


def write_serving_files(dst: Path, model_cfg: ModelConfig, data_cfg: DataConfig,
                        source: Optional[Path]) -> ServingFiles:
    """Copy from ``source`` or write into ``dst`` the tokenizer, processor and generation files."""
    source_files = _files_in(source)
    processor_files = get_family(model_cfg.family).hf_processor_files(model_cfg, data_cfg)
    done = ServingFiles()
    has_tokenizer = _has_tokenizer(source_files)
    written_tokenizer = None
    if has_tokenizer:
        _copy(source_files, TOKENIZER_FILES, dst)
        done.copied.append("tokenizer")
    else:
        written_tokenizer = _write_tokenizer_or_warn(dst, model_cfg, data_cfg, processor_files, done)
        has_tokenizer = written_tokenizer is not None
    if any(name in source_files for name in PROCESSOR_FILES):
        _copy(source_files, PROCESSOR_FILES, dst)
        done.copied.append("processor")
        done.warnings += processor_mismatches(source_files, processor_files)
    elif processor_files:
        _write_json_files(dst, processor_files)
        done.written.append("processor")
    if GENERATION_FILE in source_files:
        _copy(source_files, (GENERATION_FILE,), dst)
        done.copied.append("generation")
    elif has_tokenizer:  # its end-of-turn and padding ids are the tokenizer's
        # A config.json from the source is the source's, ids and all; one written from the model
        # config gets the tokenizer's.
        _write_generation_config(dst, model_cfg, written_tokenizer, fill_config="config.json" not in source_files)
        done.written.append("generation")
    return done


def _write_generation_config(dst: Path, model_cfg: ModelConfig, tokenizer=None, *, fill_config: bool) -> None:
    """generation_config.json from ``tokenizer`` (None: the one copied into ``dst``), and with
    ``fill_config`` its ids in the config.json where it has none."""
    if tokenizer is None:
        from transformers import AutoTokenizer  # lazy: ~1.5 s, which a training rank pays only to export

        tokenizer = AutoTokenizer.from_pretrained(dst, local_files_only=True)
    generation = generation_config(model_cfg, tokenizer)
    generation.save_pretrained(dst)
    if fill_config:
        _fill_config_token_ids(dst / "config.json", generation)


def _fill_config_token_ids(config_file: Path, generation) -> None:
    """The token ids a config.json written from the model config lacks: without them transformers fills in its class defaults, Qwen's full-vocabulary ids, which lie
    outside a smaller vocabulary (the small test vocabularies) and name other tokens in any other.
    A tokenizer without a BOS token (Qwen's) gets its padding token there, as Qwen's own configs
    have it (<|endoftext|>): transformers reads a missing or null id as "use the default"."""
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    eos = generation.eos_token_id[0] if isinstance(generation.eos_token_id, list) else generation.eos_token_id
    bos = generation.bos_token_id if generation.bos_token_id is not None else generation.pad_token_id
    ids = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": generation.pad_token_id}
    missing = {key: value for key, value in ids.items() if key not in config}
    if missing:
        config_file.write_text(json.dumps({**config, **missing}, indent=2) + "\n")  # the engine's layout


def _write_tokenizer_or_warn(dst: Path, model_cfg: ModelConfig, data_cfg: DataConfig,
                             processor_files: dict[str, dict], done: ServingFiles):
    """The run's tokenizer, written; None for a tokenizer of another model (data settings guessed
    for a checkpoint without its run's), a warning, not a failed export."""
    try:
        tokenizer = write_tokenizer(dst, model_cfg, data_cfg, processor_files)
    except ValueError as error:
        done.warnings.append(f"tokenizer and generation files not written: data.tokenizer={data_cfg.tokenizer} is "
                             f"not this model's tokenizer ({error}); set data.tokenizer to the model's own "
                             f"(convert: --preset NAME)")
        return None
    done.written.append("tokenizer")
    return tokenizer


def _files_in(source: Optional[Path]) -> dict[str, Path]:
    if source is None or not Path(source).is_dir():
        return {}
    return {path.name: path for path in Path(source).iterdir() if path.is_file()}


def _has_tokenizer(files: dict[str, Path]) -> bool:
    """A folder's tokenizer is whole with its fast file, or with a slow BPE's vocabulary and merges
    (a lone tokenizer_config.json is not a tokenizer)."""
    return "tokenizer.json" in files or {"vocab.json", "merges.txt"} <= files.keys()


def _copy(files: dict[str, Path], names: tuple[str, ...], dst: Path) -> None:
    for name in names:
        if name in files:
            shutil.copy2(files[name], dst / name)


def _write_json_files(dst: Path, files: dict[str, dict]) -> None:
    for name, content in files.items():  # transformers' layout: sorted keys, 2-space indent
        (dst / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def write_tokenizer(dst: Path, model_cfg: ModelConfig, data_cfg: DataConfig, processor_files: dict[str, dict]):
    """The run's tokenizer with the chat template loongforge renders, saved by transformers (and
    returned); ValueError if it is not the model's (the check training starts with)."""
    chat = get_family(model_cfg.family).chat(model_cfg)
    tokenizer = load_tokenizer(data_cfg.tokenizer, chat.jinja_template)
    check_token_ids(tokenizer, data_cfg, model_cfg, chat)
    tokenizer.chat_template = chat.jinja_template  # a tokenizer folder's own template is not what trained
    # The training limit, not the builder's "no limit" (which only keeps the pipeline quiet).
    tokenizer.model_max_length = model_cfg.language.max_position_embeddings
    processor_class = next((f["processor_class"] for f in processor_files.values() if "processor_class" in f), None)
    if processor_class is not None:  # what a processor's save_pretrained records in its tokenizer
        tokenizer._set_processor_class(processor_class)
    tokenizer.save_pretrained(dst)
    return tokenizer


def generation_config(model_cfg: ModelConfig, tokenizer) -> GenerationConfig:
    """Greedy defaults that end generation at the chat format's end of turn (and the tokenizer's
    end of sequence where that is another token), padding with the model's pad token."""
    from transformers import GenerationConfig  # lazy: ~1.5 s, which a training rank pays only to export

    chat = get_family(model_cfg.family).chat(model_cfg)
    end_ids = [tokenizer.convert_tokens_to_ids(chat.turn_end)]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in end_ids:
        end_ids.append(tokenizer.eos_token_id)
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=model_cfg.tokens.pad_token_id,
                            eos_token_id=end_ids[0] if len(end_ids) == 1 else end_ids)


def processor_mismatches(source_files: dict[str, Path], expected_files: dict[str, dict]) -> list[str]:
    """``FILE: KEY is FOUND, the run's data settings give EXPECTED`` for each processor setting of
    the copied files that the run fixes (``expected_files``) and that differs; keys the copy does
    not set are the processor's defaults and not compared, nor are class names."""
    lines = []
    for expected_file in expected_files.values():
        for section, expected in expected_file.items():
            if not isinstance(expected, dict):
                continue  # processor_class
            for file, prefix, found in _copied_sections(source_files, section):
                lines += _differences(file, prefix, _flat(found), _flat(expected))
    return lines


def _copied_sections(files: dict[str, Path], section: str) -> list[tuple[Path, str, dict]]:
    """(file, key prefix, settings) of each place a copied folder keeps a processor section."""
    places = []
    if "processor_config.json" in files:
        found = _read_json(files["processor_config.json"]).get(section)
        if isinstance(found, dict):
            places.append((files["processor_config.json"], f"{section}.", found))
    if _SECTION_FILES[section] in files:
        places.append((files[_SECTION_FILES[section]], "", _read_json(files[_SECTION_FILES[section]])))
    return places


def _differences(file: Path, prefix: str, found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in found.items():
        target = _KEY_ALIASES.get(key, key)
        if target.endswith("_type") or target not in expected or _same(value, expected[target]):
            continue
        lines.append(f"{file}: {prefix}{key} is {json.dumps(value)}, the run's data settings give "
                     f"{json.dumps(expected[target])} (copied as it is)")
    return lines


def _same(found: Any, expected: Any) -> bool:
    # JSON has no tuples, and a whole number may be written as 2 or 2.0.
    if isinstance(found, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(found) == len(expected) and all(_same(a, b) for a, b in zip(found, expected))
    return found == expected


def _flat(settings: dict, prefix: str = "") -> dict[str, Any]:
    """{"size": {"longest_edge": 1}} -> {"size.longest_edge": 1}."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}); fix or remove the file") from None
