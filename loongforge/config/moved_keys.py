"""Keys an older loongforge wrote flat, read at their place in today's sections.

A saved ``config.yaml`` or an old override may still hold a key that now lives in a section (the experts'
``model.language.moe``, the vision ``window`` and ``anyres``); it is moved there, and each move is one line
for the reader naming the new key.
"""

from __future__ import annotations

from typing import Callable, Mapping


def move_into_section(parent: dict, parent_key: str, names: Mapping[str, str], section: str,
                      built: Callable[[dict], bool]) -> list[str]:
    """The flat keys of ``parent`` (the tree at ``parent_key``) that ``names`` maps to ``section``'s, moved
    there in place (a flat key wins over the section's, as the later setting); the section is null where
    ``built`` says the flat values describe nothing built. One line per moved key."""
    flat = {key: parent.pop(key) for key in list(parent) if key in names}
    if not flat:
        return []
    current = parent.get(section)
    parent[section] = ({**(current if isinstance(current, dict) else {}),
                        **{names[key]: value for key, value in flat.items()}} if built(flat) else None)
    return [f"{parent_key}.{key} is now {parent_key}.{section}.{names[key]}; read so." for key in flat]
