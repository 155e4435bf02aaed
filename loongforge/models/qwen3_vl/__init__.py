"""Qwen3-VL (dense) on megatron-core.

model.py        Qwen3VLModel and build_model (the entry point)
vision.py       the ViT tower (learned, resampled position embeddings; 2-D RoPE) and patch mergers
deepstack.py    DeepStack: vision features added after the first decoder layers (block hooks)
rotary.py       interleaved M-RoPE for the decoder
layer_specs.py  the vision layer spec (the shared pre-norm block with LayerNorm pre-norms)
configs.py      Qwen3VisionConfig (the vision facts) and the towers' megatron TransformerConfigs
hf_mapping.py   transformers checkpoint -> this model, per TP rank
rope_index.py   M-RoPE position ids per sample (data side)

Not yet a registered family (no ``FAMILY``): the chat format, HF config.json conversion, parameter
count, presets and the schema fields of ``Qwen3VisionConfig`` are still to come.
"""
