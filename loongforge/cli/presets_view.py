"""What ``--list-presets`` and ``--show-preset`` print."""

from __future__ import annotations

from loongforge.config.layout import derive_parallel_sizes
from loongforge.config.loader import load_run_config
from loongforge.config.presets import (
    DEFAULT_PRESET,
    compose_preset,
    list_preset_names,
    preset_description,
    presets_dir,
)
from loongforge.config.schema import RunConfig
from loongforge.config.yaml_io import dump_yaml_tree
from loongforge.train.dry_run import human_count, layout_label, total_parameters

_COLUMNS = ("preset", "model", "parameters", "default layout", "world", "seq_len")


def _model_label(cfg: RunConfig) -> str:
    language, vision = cfg.model.language, cfg.model.vision
    towers = f"LM {language.num_layers}x{language.hidden_size}"
    if language.moe:
        towers += f" MoE {language.moe.num_experts}e top-{language.moe.router_topk}"
    return f"{cfg.model.family}: {towers}" + (f", ViT {vision.depth}x{vision.hidden_size}" if vision else "")


def _preset_row(name: str) -> tuple[str, tuple[str, ...]]:
    """(family, the table row) of one preset."""
    cfg = load_run_config(name)
    sizes = derive_parallel_sizes(cfg.parallel)
    label = f"{name} (default)" if name == DEFAULT_PRESET else name
    return cfg.model.family, (label, _model_label(cfg), human_count(total_parameters(cfg.model)),
                              layout_label(sizes), str(sizes.world_size), str(cfg.data.seq_len))


def format_presets_table() -> str:
    """One table, the presets grouped under a line naming their model family."""
    by_family: dict[str, list[tuple[str, ...]]] = {}
    for name in list_preset_names():
        family, row = _preset_row(name)
        by_family.setdefault(family, []).append(row)
    rows = [_COLUMNS, *(row for family_rows in by_family.values() for row in family_rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()

    lines = [line(_COLUMNS), "  ".join("-" * width for width in widths)]
    for family in sorted(by_family):
        lines.append(f"[family {family}]")
        lines += [line(row) for row in by_family[family]]
    lines.append(f"\npresets folder: {presets_dir()}")
    return "\n".join(lines)


def format_composed_preset(name: str) -> str:
    tree = compose_preset(name)
    header = [f"# preset {name}: {preset_description(name) or ''}".rstrip(": "),
              "# composed from its component files; keys not shown take the schema defaults",
              "# (`loongforge train --preset NAME --dry-run` prints every key)."]
    return "\n".join(header) + "\n" + dump_yaml_tree(tree)
