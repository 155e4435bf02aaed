"""The four real chat sets the data and pack benchmarks read (``bench.datasets``' readers), and a
chat written as the conversation record ``train`` and ``pack`` read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.bench.datasets import (
    ALPACA,
    ARENA_HARD,
    COCO_CAPTIONS,
    COCO_IMAGES,
    MATHVISTA,
    Chat,
    alpaca_chats,
    arena_hard_chats,
    coco_chats,
    mathvista_chats,
)

# What the benchmarks read under the data root: the sets, and COCO's images for their records.
REQUIRED = (COCO_CAPTIONS, COCO_IMAGES, MATHVISTA, ARENA_HARD, ALPACA)


def chat_sets(root: Path) -> dict[str, list[Chat]]:
    """Each real set's chats by its name, in the order the benchmarks report them."""
    return {"coco": coco_chats(root / COCO_CAPTIONS), "mathvista": mathvista_chats(root / MATHVISTA),
            "arena_hard": arena_hard_chats(root / ARENA_HARD), "alpaca": alpaca_chats(root / ALPACA)}


def chat_record(chat: Chat, images: Any) -> dict:
    """``chat`` as a conversation record (one user turn, one answer) with ``images`` as its image paths."""
    return {"messages": [{"role": "user", "content": chat.question},
                         {"role": "assistant", "content": chat.answer}], "images": images}
