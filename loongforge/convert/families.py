"""What ``loongforge convert`` knows of HF folders whatever the family: side files and config diffs.

Per-family facts (which ``architectures`` a family reads, ``config.json`` <-> ``ModelConfig``, the
tensor names and shapes a config implies, the weight map) are the family's own, reached through
``loongforge.models.registry`` (``ModelFamily.config_from_hf``, ``hf_shapes``, ``hf_rules``, ...).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig

# Files an HF model folder carries besides config.json and the weights, in the groups an export
# copies or writes whole (``convert.serving``): a tokenizer's files and its chat template, a
# processor's (transformers 5 writes processor_config.json; older Hub folders the other two), and
# the generation defaults. Kept beside a converted checkpoint so the folder exported from it loads
# with AutoProcessor / generate() like the input did.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.json", "chat_template.jinja",
)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
GENERATION_FILE = "generation_config.json"
HF_SIDE_FILES = (*TOKENIZER_FILES, *PROCESSOR_FILES, GENERATION_FILE)


def config_differences(expected: ModelConfig, found: ModelConfig) -> list[str]:
    """``section.field: expected != found`` for every architecture field that differs."""
    out = []
    for section in ("vision", "projector", "language"):
        a, b = getattr(expected, section), getattr(found, section)
        if a is None or b is None:  # a text-only model has no vision tower or projector
            if (a is None) != (b is None):
                out.append(f"model.{section}: {'none' if a is None else 'set'} != {'none' if b is None else 'set'}")
            continue
        for name in a.__dataclass_fields__:
            if name == "max_position_embeddings":
                continue  # a serving limit, not part of the weights
            if getattr(a, name) != getattr(b, name):
                out.append(f"model.{section}.{name}: {getattr(a, name)} != {getattr(b, name)}")
    return out
