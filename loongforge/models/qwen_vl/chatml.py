"""ChatML with vision blocks: the chat format of the Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The format (ChatML with vision markers)::

    <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n      (Qwen2.5-VL's default; Qwen3-VL has none)
    <|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Who is he?<|im_end|>\n
    <|im_start|>assistant\nHe's Thomas Muller.<|im_end|>\n

Each image is one ``<|image_pad|>`` in the text; after tokenization it is expanded to
``grid_t*grid_h*grid_w / merge**2`` copies (one per merged patch group), the processor's rule.
Qwen3-VL (``CHATML_VISION_TIMESTAMPED``) writes a video as a bare ``<|video_pad|>`` that becomes,
per temporal patch, ``<{t:.1f} seconds><|vision_start|>`` + that patch's pads + ``<|vision_end|>``.
The generic rendering, tokenizing and labelling is ``loongforge.data.template``.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.family import ChatFormat
from loongforge.models.qwen_vl.video import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO

QWEN2_SYSTEM_PROMPT = "You are a helpful assistant."  # Qwen2 / Qwen2.5 (-VL) templates' default


def default_system_jinja(prompt: str | None, turn_start: str = "<|im_start|>", role_end: str = "\n",
                         turn_end: str = "<|im_end|>", turn_sep: str = "\n") -> str:
    """Jinja for a template's default system turn, written before a first message that is not one."""
    if not prompt:
        return ""
    return ("{% if loop.first and message['role'] != 'system' %}"
            f"{turn_start}system{role_end}{prompt}{turn_end}{turn_sep}"
            "{% endif %}")


# Jinja rendering of the same format for `tokenizer.apply_chat_template`; messages use HF's
# content-part form ({"type": "image"} / {"type": "video"} / {"type": "text", "text": ...}).
# No whitespace control: HF renders with trim_blocks, and no newline here follows a block tag.
def chatml_vision_template(image_block: str, video_block: str, system_prompt: str | None) -> str:
    """ChatML's Jinja with these vision blocks (``""``: that medium is not written)."""
    return (
        "{% for message in messages %}"
        + default_system_jinja(system_prompt) +
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}"
        "{{ message['content'] }}"
        "{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
        + image_block +
        "{% elif part['type'] == 'video' or 'video' in part %}"
        + video_block +
        "{% elif 'text' in part %}"
        "{{ part['text'] }}"
        "{% endif %}"
        "{% endfor %}"
        "{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHATML_VISION = ChatFormat(
    turn_start="<|im_start|>",
    turn_end="<|im_end|>",
    image_block="<|vision_start|><|image_pad|><|vision_end|>",
    video_block="<|vision_start|><|video_pad|><|vision_end|>",
    jinja_template=chatml_vision_template("<|vision_start|><|image_pad|><|vision_end|>",
                                          "<|vision_start|><|video_pad|><|vision_end|>", QWEN2_SYSTEM_PROMPT),
    default_system_prompt=QWEN2_SYSTEM_PROMPT,
    video_rule=QWEN2_VL_VIDEO,
)

# Qwen3-VL (Instruct): no default system turn; the video pad stands alone and the data side writes
# each temporal patch's timestamp and vision markers around its pads (``timestamped_video_frames``),
# as Qwen3VLProcessor does.
CHATML_VISION_TIMESTAMPED = replace(
    CHATML_VISION,
    video_block="<|video_pad|>",
    jinja_template=chatml_vision_template("<|vision_start|><|image_pad|><|vision_end|>", "<|video_pad|>", None),
    default_system_prompt=None,
    timestamped_video_frames=True,
    video_rule=QWEN3_VL_VIDEO,
)


def chatml_vision(model_cfg: ModelConfig) -> ChatFormat:
    """Qwen2-VL / Qwen2.5-VL's format (``ModelFamily.chat``)."""
    return CHATML_VISION


def chatml_vision_timestamped(model_cfg: ModelConfig) -> ChatFormat:
    """Qwen3-VL's format (``ModelFamily.chat``)."""
    return CHATML_VISION_TIMESTAMPED
