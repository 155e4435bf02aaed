"""What ``loongforge convert`` knows of HF folders whatever the family: side files and config diffs.

Per-family facts (which ``architectures`` a family reads, ``config.json`` <-> ``ModelConfig``, the
tensor names and shapes a config implies, the weight map) are the family's own, reached through
``loongforge.models.registry`` (``ModelFamily.config_from_hf``, ``hf_shapes``, ``hf_rules``, ...).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig

# Files an HF model folder carries besides weights; copied through a conversion when present so the
# output loads with AutoProcessor / generate() like the input did.
HF_SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "preprocessor_config.json", "video_preprocessor_config.json",
    "processor_config.json", "chat_template.json", "chat_template.jinja", "generation_config.json",
)

def config_differences(expected: ModelConfig, found: ModelConfig) -> list[str]:
    """``section.field: expected != found`` for every architecture field that differs."""
    out = []
    for section in ("vision", "projector", "language"):
        a, b = getattr(expected, section), getattr(found, section)
        for name in a.__dataclass_fields__:
            if name == "max_position_embeddings":
                continue  # a serving limit, not part of the weights
            if getattr(a, name) != getattr(b, name):
                out.append(f"model.{section}.{name}: {getattr(a, name)} != {getattr(b, name)}")
    return out
