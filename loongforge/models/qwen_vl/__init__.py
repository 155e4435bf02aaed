"""What the Qwen-VL families share (Qwen2.5-VL, Qwen3-VL, Qwen3.5): their media processing, chat
format and processor files, used by those families' folders and the Qwen ViT towers.

smart_resize.py    Qwen2-VL's image processing (smart-resize, patches), bit-equal to transformers'
processor.py       the processor files of a Qwen-VL HF folder, and the inputs transformers' class takes
video.py           the Qwen2-VL and Qwen3-VL video rules (frame sampling and sizing, ``ChatFormat.video_rule``)
chatml.py          ChatML with vision blocks
hf_config.py       the nested config.json of the Qwen3-VL-style families (Qwen3-VL, Qwen3.5), both ways
"""
