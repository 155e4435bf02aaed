"""The pack-folder format: what ``loongforge pack`` writes and ``data.source=packed`` reads.

- ``folder``: file names inside a pack folder and the atomic way they are written;
- ``schema``: the parquet schema of the shards (one row per pack), encode and decode;
- ``reader``: a finished folder as the training stream of packed rows.

The writer lives in ``loongforge.pack``; both sides use these three modules, so the format has
one definition.
"""
