"""ERNIE-4.5-VL's vision part: a Qwen2-VL-style ViT (LayerNorm blocks, quick-GELU MLP, 2-D rotary, a final
LayerNorm) and the variable-resolution resampler (spatial then temporal merge, to the language model's width).

encoder.py      ErnieVisionEncoder: the part as one ``VisionEncoder``
checks.py       the settings it is built from, checked before a run
vision.py       the ViT and the resampler
hf_mapping.py   HF weight rows (a family adds the language model's)
"""
