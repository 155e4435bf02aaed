"""ERNIE-4.5-VL's chat format, from the template its published tokenizer_config.json carries: the text opens
with ``<|begin_of_sentence|>``; a system turn is its text and a newline, a user turn ``User: `` and its text,
an assistant turn a newline, ``Assistant: ``, its text and ``<|end_of_sentence|>``; an image is
``Picture n:`` (n its count in the conversation: ``ChatFormat.image_label``) then
``<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>``.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.family import ChatFormat

BEGIN, END = "<|begin_of_sentence|>", "<|end_of_sentence|>"
IMAGE_BLOCK = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"

# A message's content: a string, or items (text, and images written as their block).
_CONTENT = ("{%- if message.content is string -%}{{- message.content -}}{%- else -%}"
            "{%- for item in message.content -%}{%- if item.type == 'text' -%}{{- item.text -}}"
            "{%- elif item.type in ['image', 'image_url'] -%}{%- set images.count = images.count + 1 -%}"
            "{{- 'Picture ' ~ images.count ~ ':" + IMAGE_BLOCK + "' -}}{%- endif -%}{%- endfor -%}"
            "{%- endif -%}")
TEMPLATE = (
    "{%- set images = namespace(count=0) -%}"
    "{{- '" + BEGIN + "' -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}{{- '\\nAssistant: ' -}}" + _CONTENT + "{{- '" + END + "' -}}"
    "{%- elif message.role == 'system' -%}" + _CONTENT + "{{- '\\n' -}}"
    "{%- else -%}{{- 'User: ' -}}" + _CONTENT + "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\nAssistant: ' -}}{%- endif -%}"
)

CHAT = ChatFormat(
    # Every role the template writes has a header and an end of its own below; a turn of another role would be
    # written as a user's (the template writes system and user turns alike).
    turn_start="User: ", turn_end=END, jinja_template=TEMPLATE, image_block=IMAGE_BLOCK, role_end="", turn_sep="",
    text_start=BEGIN, document_end=END,
    role_headers=(("system", ""), ("user", "User: "), ("assistant", "\nAssistant: ")),
    role_turn_ends=(("system", "\n"), ("user", "")),
    vision_tokens=(("<|IMAGE_PLACEHOLDER|>", "image_token_id"), ("<|IMAGE_START|>", "vision_start_token_id"),
                   ("<|IMAGE_END|>", "vision_end_token_id")),
    wraps_images=False,
    image_label="Picture {index}:",
)


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    return CHAT
