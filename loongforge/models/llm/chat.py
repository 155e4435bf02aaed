"""The chat format of the text-only family: ChatML, as Qwen2.5 and Qwen3 instruct models use it.

    <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
    <|im_start|>user\nWhat is 2 + 2?<|im_end|>\n
    <|im_start|>assistant\n4<|im_end|>\n

No vision blocks: a sample with an image or a video is a counted reject (the model cannot see it).
"""

from __future__ import annotations

from loongforge.models.family import ChatFormat

CHATML_TEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT = ChatFormat(
    turn_start="<|im_start|>",
    turn_end="<|im_end|>",
    image_block="",
    video_block="",
    jinja_template=CHATML_TEXT_TEMPLATE,
)
