"""The vision side's optional kinds as config sections, each with its own checks.

``model.vision`` holds what every tower has (depth, widths, heads, patch, norm); what only some towers or
processors build is a section of its own, null where the run does not build it:

- ``window``: attention inside windows of a few merged tokens, the listed blocks over the whole image
  (Qwen2.5-ViT);
- ``anyres``: a single image tiled into crops of the tower's square on a canvas chosen from a list, the
  crops' features pooled past a budget (LLaVA-OneVision's processor).

A section checks itself (``problems``: one line per problem naming its key and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.config.moved_keys import move_into_section

VISION_KEY = "model.vision"


@dataclass
class WindowAttentionConfig:
    """Window attention: the blocks attend inside windows of ``size`` pixels (tiled from each frame's top-left
    in merge units, edge windows smaller), except the ``fullatt_block_indexes`` ones, which attend over the
    whole image."""

    KEY = f"{VISION_KEY}.window"

    # Pixel side of one window; 112 px = 8x8 patches = 4x4 merged tokens.
    size: int = 112
    # Blocks that attend over the whole image instead of inside windows.
    fullatt_block_indexes: list[int] = field(default_factory=list)

    def problems(self, *, depth: int, patch_size: int, spatial_merge_size: int) -> list[str]:
        errors = []
        outside = [index for index in self.fullatt_block_indexes if not 0 <= index < depth]
        if outside:
            errors.append(f"{self.KEY}.fullatt_block_indexes has {outside} outside the {depth} vision blocks; use "
                          f"indexes 0..{depth - 1}.")
        merged_patch_px = patch_size * spatial_merge_size
        if self.size < 1 or self.size % merged_patch_px:
            errors.append(f"{self.KEY}.size={self.size} px must be a multiple of patch_size x spatial_merge_size = "
                          f"{merged_patch_px} px so windows hold whole merged tokens.")
        return errors

    def full_attention_blocks(self, depth: int) -> int:
        """How many of the ``depth`` blocks attend over the whole image."""
        return sum(1 for index in set(self.fullatt_block_indexes) if 0 <= index < depth)


@dataclass
class AnyresConfig:
    """anyres: a sample's only image is tiled into crops of the tower's square (``model.vision.image_size``)
    on the canvas from ``pinpoints`` that fits it best, after a base square of the whole image; past
    ``max_crops`` crops' worth of features the crops are pooled (``anyres_max_9``)."""

    KEY = f"{VISION_KEY}.anyres"

    # The (height, width) canvases in pixels, multiples of model.vision.image_size.
    pinpoints: list[list[int]] = field(default_factory=list)
    max_crops: int = 9

    def problems(self, *, image_size: int | None) -> list[str]:
        if image_size is None:
            return [f"{self.KEY} tiles crops of the tower's square: set {VISION_KEY}.image_size."]
        errors = []
        if not self.pinpoints:
            errors.append(f"{self.KEY}.pinpoints is empty; list the (height, width) canvases a single image may be "
                          f"tiled into.")
        off_grid = [pair for pair in self.pinpoints
                    if len(pair) != 2 or any(side < image_size or side % image_size for side in pair)]
        if off_grid:
            errors.append(f"{self.KEY}.pinpoints has {off_grid}: each is a (height, width) pair of multiples of "
                          f"{VISION_KEY}.image_size={image_size}.")
        if self.max_crops < 1:
            errors.append(f"{self.KEY}.max_crops={self.max_crops} must be at least 1.")
        return errors


# Keys of model.vision that moved into a section: old flat name -> name in the section.
MOVED_TO_WINDOW = {"window_size": "size", "fullatt_block_indexes": "fullatt_block_indexes"}
MOVED_TO_ANYRES = {"anyres_pinpoints": "pinpoints", "anyres_max_crops": "max_crops"}


def move_flat_vision_keys(vision: dict) -> list[str]:
    """A ``model.vision`` tree with the window and anyres keys written flat, as before their sections (a saved
    config.yaml, an old override), changed in place to the sections; one line per moved key. A null
    ``window_size`` or an empty ``anyres_pinpoints`` was "not built": that section is null."""
    return (move_into_section(vision, VISION_KEY, MOVED_TO_WINDOW, "window",
                              built=lambda flat: flat.get("window_size", 112) is not None)
            + move_into_section(vision, VISION_KEY, MOVED_TO_ANYRES, "anyres",
                                built=lambda flat: bool(flat.get("anyres_pinpoints", True))))
