"""``loongforge pack``: offline packing of conversation files into fixed-capacity packs.

Stages, each persisted in the output folder so ``--resume`` continues where a run stopped:

1. scan (``scan.py``): every input sample -> exact LLM tokens, vision patches per image/video,
   media counts, or a reject reason; written in fixed chunks under ``scan/``.
2. plan (``plan.py``): pure bin packing (``algorithms.py``, no torch) -> ``manifest.jsonl`` and
   ``rejects.jsonl``.
3. write (``write.py``): packed parquet shards under ``shards/`` (schema in ``shard_format.py``),
   then ``stats.json``, whose presence marks a finished folder.

``job.run_pack`` runs them; ``loongforge.data.packfile.reader`` reads the folder back for ``train``.
"""
