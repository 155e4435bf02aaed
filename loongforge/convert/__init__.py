"""``loongforge convert``: Hugging Face <-> megatron-core checkpoints, streamed tensor by tensor.

- ``families``: what holds for HF folders of every family (side files, config differences); the
  per-family facts (architectures, config.json both ways, shapes, mapping table) are the family's
  ``ModelFamily``, reached through ``loongforge.models.registry``;
- ``hf_io``: HF folders (safetensors shards + index) read and written one tensor at a time;
- ``mcore_io``: dist_checkpointing (torch_dist) folders read and written one chunk at a time;
- ``engine``: the conversion itself, driven by the family's mapping table
  (``ModelFamily.hf_rules``), with ``--verify``;
- ``roundtrip``: HF -> a sharded megatron checkpoint (temporary) -> HF, exact / close / different per tensor;
- ``check_logits``: the family's own model against transformers on one built-in sample (``--check-logits``);
- ``model_io``: HF weights into a built model (``checkpoint.load_hf``) and a run's checkpoint out
  as HF (``checkpoint.save_hf``);
- ``serving``: what makes an exported HF folder ready to serve (tokenizer, chat template, image and
  video processors, generation defaults), copied from the source folder or written from the run's
  settings, for ``--to hf`` and ``checkpoint.save_hf`` alike.
"""
