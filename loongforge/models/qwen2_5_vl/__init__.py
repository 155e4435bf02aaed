"""Qwen2.5-VL on megatron-core.

model.py        Qwen2_5_VLModel and build_model (the entry point)
vision.py       the ViT tower and patch merger (window attention, 2-D RoPE)
layer_specs.py  megatron-core layer specs shared by both towers
configs.py      ModelConfig -> megatron TransformerConfigs
process_groups.py  the vision tower's own tensor-parallel groups
hf_mapping.py   transformers checkpoint <-> this model, per TP rank
params.py       parameter counts by arithmetic
rope_index.py   M-RoPE position ids per sample (data side)
"""
