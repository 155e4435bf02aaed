"""``loongforge encode``: the vision encoder run offline over a dataset's images and videos.

plan.py    the media to encode, each one's process and shard (the same in every process)
worker.py  one process: its encoder, its shards decoded, encoded and written
job.py     run_encode: the folder, the processes, the index and encoder.json at the end

The folder format and its reader are ``loongforge.data.embedding_store`` (training reads it).
"""
