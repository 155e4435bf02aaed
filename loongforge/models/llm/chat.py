"""The chat formats of the text-only family, one per architecture (``chat_format``).

Qwen2 / Qwen2.5 and Qwen3 instruct models use ChatML::

    <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
    <|im_start|>user\nWhat is 2 + 2?<|im_end|>\n
    <|im_start|>assistant\n4<|im_end|>\n

Llama 3.x instruct models use header tokens, with nothing between turns::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>

(one line per turn here for reading; the text has no newline after ``<|eot_id|>``). No vision
blocks: a sample with an image or a video is a counted reject (the model cannot see it).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.family import ChatFormat
from loongforge.models.llm.hf_config import architecture

# The Jinja twins below render the same text as ``data.template`` (messages as strings or as HF
# content parts, of which only text parts exist here). No whitespace control: HF renders with
# trim_blocks, and no newline here follows a block tag.
_CONTENT = (
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
)

CHATML_TEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    + _CONTENT +
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    + _CONTENT +
    "<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHATML = ChatFormat(
    turn_start="<|im_start|>",
    turn_end="<|im_end|>",
    image_block="",
    video_block="",
    jinja_template=CHATML_TEXT_TEMPLATE,
)

LLAMA3 = ChatFormat(
    turn_start="<|start_header_id|>",
    turn_end="<|eot_id|>",
    image_block="",
    video_block="",
    jinja_template=LLAMA3_TEMPLATE,
    role_end="<|end_header_id|>\n\n",
    turn_sep="",
    text_start="<|begin_of_text|>",
)

# transformers architecture -> its instruct models' chat format
_FORMATS = {"Qwen2ForCausalLM": CHATML, "Qwen3ForCausalLM": CHATML, "LlamaForCausalLM": LLAMA3}


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    """The chat format of the architecture ``model.language`` describes."""
    return _FORMATS[architecture(model_cfg.language)]
