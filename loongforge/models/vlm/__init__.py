"""Vision-language models composed of parts: a family's vision part (tower + projector, any side
projectors) as a ``VisionEncoder``, and the shared decoder (``models.decoder``).

encoder.py         the vision-part contract (``VisionEncoder``, ``EncoderBuild``) and the encoder alone
model.py           VisionLanguageModel and build_vlm: one pipeline stage of any VLM, every layout
deepstack.py       side feature sets added after the first decoder layers (Qwen3-VL's DeepStack)
mrope_index.py     M-RoPE position ids per sample (Qwen's rule; families bind their variant)
interleaved_mrope.py  Qwen3-VL's and Qwen3.5's interleaved M-RoPE angles (the decoder's rotary module)
process_groups.py  the vision tower's own tensor-parallel groups (vision TP below the language TP)
"""
