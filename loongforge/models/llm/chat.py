"""The chat formats of the text-only family, one per architecture (``chat_format``).

Qwen2 / Qwen2.5 instruct models use ChatML with a default system turn::

    <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
    <|im_start|>user\nWhat is 2 + 2?<|im_end|>\n
    <|im_start|>assistant\n4<|im_end|>\n

Qwen3 (hybrid thinking) has no default system turn and writes the reasoning of the answer to the
last question in a think block, empty when there is none (``data.template.with_reasoning_block``)::

    <|im_start|>user\nWhat is 2 + 2?<|im_end|>\n
    <|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n

Llama 3.x instruct models use header tokens, with nothing between turns::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>

(one line per turn here for reading; the text has no newline after ``<|eot_id|>``). No vision
blocks: a sample with an image or a video is a counted reject (the model cannot see it).
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.chatml import QWEN2_SYSTEM_PROMPT, default_system_jinja
from loongforge.models.family import ChatFormat
from loongforge.models.decoder.text_config import architecture

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
    + default_system_jinja(QWEN2_SYSTEM_PROMPT) +
    "<|im_start|>{{ message['role'] }}\n"
    + _CONTENT +
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3: an assistant message after the last user message keeps its reasoning (split at </think>)
# in a normalised block, the conversation's last one even when empty; earlier ones lose it.
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last_user=-1, text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% set ns.text = '' %}"
    "{% if message['content'] is string %}{% set ns.text = message['content'] %}"
    "{% else %}{% for part in message['content'] %}"
    "{% if 'text' in part %}{% set ns.text = ns.text + part['text'] %}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% set answer = ns.text %}{% set reasoning = '' %}"
    "{% if '</think>' in ns.text %}"
    "{% set answer = ns.text.split('</think>')[-1].lstrip('\\n') %}"
    "{% set reasoning = ns.text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{% if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n{{ answer.lstrip('\\n') }}"
    "{% else %}{{ answer }}{% endif %}"
    "{% else %}"
    + _CONTENT +
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{% for message in messages %}"
    + default_system_jinja(QWEN2_SYSTEM_PROMPT, "<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>", "") +
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
    default_system_prompt=QWEN2_SYSTEM_PROMPT,
)

QWEN3 = replace(CHATML, jinja_template=QWEN3_TEMPLATE, default_system_prompt=None, thinking=True)

LLAMA3 = ChatFormat(
    turn_start="<|start_header_id|>",
    turn_end="<|eot_id|>",
    image_block="",
    video_block="",
    jinja_template=LLAMA3_TEMPLATE,
    role_end="<|end_header_id|>\n\n",
    turn_sep="",
    text_start="<|begin_of_text|>",
    document_end="<|end_of_text|>",
    # Not Llama 3.1's own (its template writes a knowledge-date system turn): the one every family
    # trained with before formats carried their own default.
    default_system_prompt=QWEN2_SYSTEM_PROMPT,
)

# transformers architecture -> its instruct models' chat format
_FORMATS = {"Qwen2ForCausalLM": CHATML, "Qwen3ForCausalLM": QWEN3, "Qwen3MoeForCausalLM": QWEN3,
            "LlamaForCausalLM": LLAMA3}


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    """The chat format of the architecture ``model.language`` describes."""
    return _FORMATS[architecture(model_cfg.language)]
