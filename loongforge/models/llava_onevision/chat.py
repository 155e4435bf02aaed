"""LLaVA-OneVision's chat format: ChatML turns with no separator between them, where each turn is written
as its images (``<image>`` each), then each piece of its text after a newline (``ChatFormat.media_first``:
its template renders a message's image parts first, wherever they stand); transformers'
``LlavaOnevisionProcessor`` expands each ``<image>`` to the image's anyres token count. Its video path
(frames pooled 2 x 2) is not loongforge's yet: videos are rejected (``video_in_image_model``).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.family import ChatFormat

IMAGE_BLOCK = "<image>"

# The same format for ``apply_chat_template`` (content-part messages): a message's image parts first,
# then each text part after a newline.
_JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}"
    "{{ '\\n' + message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ '\\n' + part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CHAT = ChatFormat(
    turn_start="<|im_start|>",
    turn_end="<|im_end|>",
    image_block=IMAGE_BLOCK,
    video_block="",
    jinja_template=_JINJA,
    turn_sep="",
    media_first=True,
    vision_tokens=(("<image>", "image_token_id"),),
)


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    return CHAT
