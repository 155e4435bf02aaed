"""Turn arena-hard's model-answer JSONL into plain chat JSONL that `loongforge train` reads.

arena-hard stores each assistant turn as ``{"content": {"answer": "..."}}``; the chat readers
expect strings. Usage:

    python scripts/arena_hard_to_chat.py ../shared/data/arena_hard/v2.0_model_answer_o3-mini-2025-01-31.jsonl out.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def convert(src: Path, dst: Path) -> int:
    count = 0
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for line in f:
            if not line.strip():
                continue
            messages = []
            for message in json.loads(line)["messages"]:
                content = message["content"]
                if isinstance(content, dict):
                    content = content["answer"]
                messages.append({"role": message["role"], "content": content})
            out.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            count += 1
    return count


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"wrote {convert(Path(sys.argv[1]), Path(sys.argv[2]))} conversations to {sys.argv[2]}")
