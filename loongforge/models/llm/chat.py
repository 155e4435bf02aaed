"""The chat formats of the text-only family, one per architecture (``chat_format``).

Qwen2 / Qwen2.5 instruct models use ChatML with a default system turn::

    <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
    <|im_start|>user\nWhat is 2 + 2?<|im_end|>\n
    <|im_start|>assistant\n4<|im_end|>\n

Qwen3-Next's instruct models (Qwen3-Next-80B-A3B-Instruct, as Qwen3's 2507 instruct ones) write ChatML with no
default system turn and no think block: an answer is written as the data gives it. (Qwen3-Next's thinking
models write Qwen3's blocks below: ``model.chat_format: qwen3``.) Qwen3.5's decoder read as a text model
(``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) takes the same text format: the Qwen3.5 family's default, Qwen3-VL's
ChatML, without vision blocks.

Qwen3 (hybrid thinking) has no default system turn and writes the reasoning of the answer to the
last question in a think block, empty when there is none (``data.template.with_reasoning_block``)::

    <|im_start|>user\nWhat is 2 + 2?<|im_end|>\n
    <|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n

DeepSeek-V3 (and, here, every DeepSeek architecture) marks the roles by tokens and ends only the
assistant's turns, a system prompt bare after the start::

    <｜begin▁of▁sentence｜>You are terse.<｜User｜>What is 2 + 2?<｜Assistant｜>4<｜end▁of▁sentence｜>

Llama 3.x instruct models use header tokens, with nothing between turns::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>

(one line per turn here for reading; the text has no newline after ``<|eot_id|>``).

Llama 2 chat models (``model.chat_format: llama2``; the architecture is Llama 3's) put each exchange in
``[INST]`` ... ``[/INST]``, the system prompt inside the first one, every message stripped::

    <s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is 2 + 2? [/INST] 4 </s><s>[INST] And 3 + 3? [/INST] 6 </s>

No vision
blocks: a sample with an image or a video is a counted reject (the model cannot see it).
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.errors import ConfigError
from loongforge.config.schema import ModelConfig
from loongforge.models.qwen_vl.chatml import QWEN2_SYSTEM_PROMPT, default_system_jinja
from loongforge.models.family import ChatFormat
from loongforge.models.decoder.text_config import architecture
from loongforge.models.llm.minimax_m2 import MINIMAX_M2_ARCHITECTURE

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

# A message's text into ns.text: its content string, or its text parts joined (Jinja's set inside a loop needs ns).
_MESSAGE_TEXT = (
    "{% set ns.text = '' %}"
    "{% if message['content'] is string %}{% set ns.text = message['content'] %}"
    "{% else %}{% for part in message['content'] %}"
    "{% if 'text' in part %}{% set ns.text = ns.text + part['text'] %}{% endif %}"
    "{% endfor %}{% endif %}"
)


def _split_reasoning(*, strip_answer: bool) -> str:
    """ns.text split at </think> into ``answer`` and ``reasoning`` (its <think> dropped): Qwen3's template strips
    the newlines next to the split only (the answer's leading, the reasoning's both ends); with ``strip_answer``
    (MiniMax-M2's) both pieces lose them at both ends."""
    outer, inner, answer = ("strip", "strip", "strip") if strip_answer else ("rstrip", "lstrip", "lstrip")
    return ("{% set answer = ns.text %}{% set reasoning = '' %}"
            "{% if '</think>' in ns.text %}"
            f"{{% set answer = ns.text.split('</think>')[-1].{answer}('\\n') %}}"
            f"{{% set reasoning = ns.text.split('</think>')[0].{outer}('\\n').split('<think>')[-1].{inner}('\\n') %}}"
            "{% endif %}")


# Qwen3-Next-Instruct's: ChatML without a default system turn.
QWEN3_INSTRUCT_TEMPLATE = (
    "{% for message in messages %}"
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
    + _MESSAGE_TEXT + _split_reasoning(strip_answer=False) +
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
    jinja_template=CHATML_TEXT_TEMPLATE,
    default_system_prompt=QWEN2_SYSTEM_PROMPT,
)

QWEN3 = replace(CHATML, jinja_template=QWEN3_TEMPLATE, default_system_prompt=None, thinking=True)

QWEN3_INSTRUCT = replace(CHATML, jinja_template=QWEN3_INSTRUCT_TEMPLATE, default_system_prompt=None)

LLAMA3 = ChatFormat(
    turn_start="<|start_header_id|>",
    turn_end="<|eot_id|>",
    jinja_template=LLAMA3_TEMPLATE,
    role_end="<|end_header_id|>\n\n",
    turn_sep="",
    text_start="<|begin_of_text|>",
    document_end="<|end_of_text|>",
    # Not Llama 3.1's own (its template writes a knowledge-date system turn): the one every family
    # trained with before formats carried their own default.
    default_system_prompt=QWEN2_SYSTEM_PROMPT,
)

# Llama 2's: each exchange opened by <s> and its user text in [INST] ... [/INST], the system prompt inside the
# first one's [INST] (<<SYS>> ... <</SYS>>), every message stripped, the answer ended by </s>; no default system
# prompt. [INST] and <<SYS>> are plain text to its SentencePiece tokenizer: only <s> and </s> are its tokens.
_LLAMA2_HEADERS = {"system": "[INST] <<SYS>>\n", "user": "<s>[INST] ", "assistant": " "}
LLAMA2_TEMPLATE = (
    "{% set ns = namespace(text='') %}"
    "<s>"
    "{% for message in messages %}"
    + _MESSAGE_TEXT +
    "{% if message['role'] == 'system' %}" + _LLAMA2_HEADERS["system"] + "{{ ns.text.strip() }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}"
    "{% if loop.first %}[INST] {% elif loop.previtem['role'] != 'system' %}" + _LLAMA2_HEADERS["user"] + "{% endif %}"
    "{{ ns.text.strip() }} [/INST]"
    "{% else %}" + _LLAMA2_HEADERS["assistant"] + "{{ ns.text.strip() }} </s>{% endif %}"
    "{% endfor %}"
)
LLAMA2 = ChatFormat(
    turn_start="<s>",
    turn_end="</s>",
    jinja_template=LLAMA2_TEMPLATE,
    role_end="",
    turn_sep="",
    text_start="<s>",
    document_end="</s>",
    role_headers=tuple(_LLAMA2_HEADERS.items()),
    role_turn_ends=(("system", "\n<</SYS>>\n\n"), ("user", " [/INST]"), ("assistant", " </s>")),
    headers_after=(("", "user", "[INST] "), ("system", "user", "")),
    special_tokens=("<s>", "</s>"),
    strips_turns=True,
)

# DeepSeek-V3's: the roles as tokens of their own, only the assistant's turns ended, a system prompt as bare
# text after the start (no default one).
_DEEPSEEK_BOS, _DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DEEPSEEK_HEADERS = {"system": "", "user": "<｜User｜>", "assistant": "<｜Assistant｜>"}
DEEPSEEK_V3_TEMPLATE = (
    _DEEPSEEK_BOS
    + "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + _DEEPSEEK_HEADERS["user"] + "{% endif %}"
    "{% if message['role'] == 'assistant' %}" + _DEEPSEEK_HEADERS["assistant"] + "{% endif %}"
    + _CONTENT +
    "{% if message['role'] == 'assistant' %}" + _DEEPSEEK_EOS + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + _DEEPSEEK_HEADERS["assistant"] + "{% endif %}"
)
DEEPSEEK_V3 = ChatFormat(
    turn_start="",
    turn_end=_DEEPSEEK_EOS,
    jinja_template=DEEPSEEK_V3_TEMPLATE,
    role_end="",
    turn_sep="",
    text_start=_DEEPSEEK_BOS,
    document_end=_DEEPSEEK_EOS,
    role_headers=tuple(_DEEPSEEK_HEADERS.items()),
    role_turn_ends=(("system", ""), ("user", "")),
)

# MiniMax-M2's: ]~!b[ once, each turn ]~b] + its role (the assistant's "ai") + a newline, ended by [e~[ and a newline;
# a system turn always (its template's model_identity where the conversation has none: MiniMax-M2's is the bare
# sentence, M2.1's and later name the model). An answer after the last user turn keeps its reasoning (split at
# </think>) in a think block where it has some; earlier answers lose theirs; an answer split from its reasoning is
# stripped of newlines at both ends.
MINIMAX_M2_SYSTEM_PROMPT = "You are a helpful assistant."
_MINIMAX_HEADERS = {"system": "]~b]system\n", "user": "]~b]user\n", "assistant": "]~b]ai\n"}
MINIMAX_M2_TEMPLATE = (
    "{% set ns = namespace(last_user=-1, text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "]~!b["
    "{% for message in messages %}"
    + default_system_jinja(MINIMAX_M2_SYSTEM_PROMPT, "]~b]", "\n", "[e~[", "\n") +
    "{% if message['role'] == 'assistant' %}" + _MINIMAX_HEADERS["assistant"]
    + _MESSAGE_TEXT + _split_reasoning(strip_answer=True) +
    "{% if reasoning and loop.index0 > ns.last_user %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{{ answer }}"
    "{% else %}]~b]{{ message['role'] }}\n" + _CONTENT + "{% endif %}"
    "[e~[\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + _MINIMAX_HEADERS["assistant"] + "<think>\n{% endif %}"  # its thinking opens
)
MINIMAX_M2 = ChatFormat(
    turn_start="]~b]",
    turn_end="[e~[",
    jinja_template=MINIMAX_M2_TEMPLATE,
    text_start="]~!b[",
    document_end="[e~[",
    role_headers=tuple(_MINIMAX_HEADERS.items()),
    default_system_prompt=MINIMAX_M2_SYSTEM_PROMPT,
    thinking=True,
    reasoning_turns="some_after_last_user",
)

# The formats by name (``model.chat_format``), and each transformers architecture's instruct models' own.
FORMATS = {"chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3, "deepseek_v3": DEEPSEEK_V3, "llama2": LLAMA2}
_ARCHITECTURE_FORMATS = {"Qwen2ForCausalLM": CHATML, "Qwen2MoeForCausalLM": CHATML, "QWenLMHeadModel": CHATML,
                         "Qwen3ForCausalLM": QWEN3, "Qwen3MoeForCausalLM": QWEN3,
                         "Qwen3NextForCausalLM": QWEN3_INSTRUCT, "Qwen3_5ForCausalLM": QWEN3_INSTRUCT,
                         "Qwen3_5MoeForCausalLM": QWEN3_INSTRUCT,
                         "LlamaForCausalLM": LLAMA3, "DeepseekV2ForCausalLM": DEEPSEEK_V3,
                         "DeepseekV3ForCausalLM": DEEPSEEK_V3, "DeepseekV32ForCausalLM": DEEPSEEK_V3,
                         MINIMAX_M2_ARCHITECTURE: MINIMAX_M2,
                         "MiMoV2FlashForCausalLM": QWEN3}


def chat_format_problems(model_cfg: ModelConfig) -> list[str]:
    """A ``model.chat_format`` that is another family's (``CHAT_FORMATS`` holds every family's names)."""
    name = model_cfg.chat_format
    if name is None or name in FORMATS:
        return []
    return [f"model.chat_format='{name}' is not a text model's format; set one of {' | '.join(FORMATS)}, or null for "
            "the architecture's own."]


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    """``model.chat_format`` by name, else the chat format of the architecture ``model.language`` describes."""
    if model_cfg.chat_format is not None:
        return FORMATS[model_cfg.chat_format]
    own = architecture(model_cfg.language)
    if own not in _ARCHITECTURE_FORMATS:  # GLM-5's template is not checked against its tokenizer yet
        raise ConfigError([f"model.chat_format=null but {own}'s own chat format is not built in loongforge yet; "
                           f"set the format of the run's tokenizer ({' | '.join(FORMATS)})."])
    return _ARCHITECTURE_FORMATS[own]
