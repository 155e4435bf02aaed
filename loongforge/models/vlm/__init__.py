"""Vision-language models composed of parts: a family's vision part (tower + projector, any side
projectors) as a ``VisionEncoder``, and the shared decoder (``models.decoder``).

encoder.py         the vision-part contract (``VisionEncoder``, ``EncoderBuild``) and the encoder alone
model.py           VisionLanguageModel and build_vlm: one pipeline stage of any VLM, every layout
deepstack.py       side feature sets added after the first decoder layers (Qwen3-VL's DeepStack)
mrope_index.py     M-RoPE position ids per sample (Qwen's rule; families bind their variant)
interleaved_mrope.py  Qwen3-VL's and Qwen3.5's interleaved M-RoPE angles (the decoder's rotary module)
process_groups.py  the vision tower's own tensor-parallel groups (vision TP below the language TP)
encoder_share.py   parallel.encoder_dp=tp: ranks that share a micro-batch divide its media
encoder_full.py    parallel.encoder_dp=full: the model-parallel group divides a whole step's media
vision_common.py   family-independent pieces of vision towers and of writing their features into text
vision_configs.py  megatron-core TransformerConfigs of vision towers and projector MLPs
pixels.py          pixel operations every image processor shares (transformers' numpy path)
fingerprint.py     a digest of a module's weights (which encoder produced stored embeddings)
"""
