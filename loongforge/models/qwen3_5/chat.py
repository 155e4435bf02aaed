"""The chat formats of the Qwen3.5 architecture, one per published template (``model.chat_format``).

Qwen3.6 and Qwen3.8 are Qwen3.5's architecture (the same config.json fields) with templates of their own, so
the template is a fact of the version the run names, not of the architecture:

- null: Qwen3-VL's ChatML (``qwen_vl.chatml``), the family's format before its versions had theirs;
- ``qwen3.5``: Qwen3.5's own (Qwen3.5-4B and larger), thinking: every assistant turn after the last user turn
  writes its reasoning in a block, empty when the data has none; earlier turns drop theirs; every turn's text
  trimmed::

    <|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Who is he?<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\nThomas Muller.<|im_end|>\\n

- ``qwen3.5-nothink``: the template Qwen3.5-2B and smaller ship: the same text; only its generation prompt
  differs, writing the empty block unless a caller sets ``enable_thinking=True``;
- ``qwen3.6``: Qwen3.5's text (its template adds ``preserve_thinking``, off unless a caller sets it, and
  stringifies tool-call arguments its own way, neither of which a training conversation here reaches);

- ``qwen3.8``: as Qwen3.6's, but every assistant turn keeps its block (``preserve_thinking`` on by default), and
  with thinking on the system turn opens with the ``reasoning_effort`` sentence (the default effort, xhigh; a
  system turn of its own where the conversation has none); ``qwen3.8-medium`` writes no sentence (as thinking
  off does), ``qwen3.8-low`` the low one.

Each format's Jinja twin renders the same text through ``apply_chat_template`` (messages as strings or HF content
parts, an assistant's reasoning inline before ``</think>``; its generation prompt opens a think block, an empty
one with ``enable_thinking=False``, as the published templates do). No whitespace control: HF renders with
trim_blocks, and no newline here follows a block tag.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.family import ChatFormat
from loongforge.models.qwen_vl.chatml import CHATML_VISION_TIMESTAMPED

# The sentences Qwen3.8's template writes at the head of the system turn, by reasoning effort (medium: none).
REASONING_EFFORT_SENTENCES = {
    "xhigh": ("Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, "
              "consider plausible alternatives, and prioritize correctness, consistency, and clarity in the final "
              "answer."),
    "medium": "",
    "low": ("Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion "
            "without unnecessary elaboration."),
}


def thinking_template(image_block: str, video_block: str, *, preamble: str | None, every_turn: bool,
                      thinks_by_default: bool = True) -> str:
    """The Jinja twin of a thinking format: the system turn built from ``preamble`` and its text (None: written as
    it is), reasoning blocks after the last user turn (``every_turn``: in every assistant turn), every text trimmed;
    the generation prompt opens a think block unless ``enable_thinking`` is false (``thinks_by_default`` False:
    only where it is true; otherwise the block is written empty)."""
    keep = "true" if every_turn else "loop.index0 > ns.last_user"
    thinks = ("not (enable_thinking is defined and enable_thinking is false)" if thinks_by_default
              else "enable_thinking is defined and enable_thinking is true")
    system = "<|im_start|>system\n{{ text }}<|im_end|>\n"
    if preamble is not None:
        system = ("{% set text = ((preamble ~ '\\n\\n') if preamble else '') ~ text if text else preamble %}"
                  "{% if text %}" + system + "{% endif %}")
    return (
        # Qwen3.8's sentence is written while thinking is on (a caller's enable_thinking=False drops it).
        "{% set preamble = '' if enable_thinking is defined and enable_thinking is false else '" + (preamble or "")
        + "' %}"
        "{% set ns = namespace(last_user=-1, text='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
        "{% endfor %}"
        "{% if preamble and messages[0]['role'] != 'system' %}<|im_start|>system\n{{ preamble }}<|im_end|>\n{% endif %}"
        "{% for message in messages %}"
        "{% set ns.text = '' %}"
        "{% if message['content'] is string %}{% set ns.text = message['content'] %}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
        "{% set ns.text = ns.text + '" + image_block + "' %}"
        "{% elif part['type'] == 'video' or 'video' in part %}"
        "{% set ns.text = ns.text + '" + video_block + "' %}"
        "{% elif 'text' in part %}{% set ns.text = ns.text + part['text'] %}"
        "{% endif %}"
        "{% endfor %}{% endif %}"
        "{% set text = ns.text | trim %}"
        "{% if loop.first and message['role'] == 'system' %}"
        + system +
        "{% elif message['role'] == 'assistant' %}"
        "{% set answer = text %}{% set reasoning = '' %}"
        "{% if '</think>' in text %}"
        "{% set answer = text.split('</think>')[-1].lstrip('\\n') %}"
        "{% set reasoning = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') | trim %}"
        "{% endif %}"
        "<|im_start|>assistant\n"
        "{% if " + keep + " %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
        "{{ answer }}<|im_end|>\n"
        "{% else %}"
        "<|im_start|>{{ message['role'] }}\n{{ text }}<|im_end|>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if " + thinks + " %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )


def _thinking_format(*, preamble: str | None = None, every_turn: bool = False,
                     thinks_by_default: bool = True) -> ChatFormat:
    base = CHATML_VISION_TIMESTAMPED
    return replace(base, thinking=True, strips_turns=True, system_preamble=preamble,
                   reasoning_turns="all" if every_turn else "after_last_user",
                   jinja_template=thinking_template(base.image_block, base.video_block, preamble=preamble,
                                                    every_turn=every_turn, thinks_by_default=thinks_by_default))


QWEN3_5 = _thinking_format()
QWEN3_5_NOTHINK = _thinking_format(thinks_by_default=False)
QWEN3_6 = QWEN3_5  # the same text (module docstring)
QWEN3_8 = {effort: _thinking_format(preamble=sentence, every_turn=True)
           for effort, sentence in REASONING_EFFORT_SENTENCES.items()}

# model.chat_format -> the format (null: Qwen3-VL's ChatML).
FORMATS = {"qwen3.5": QWEN3_5, "qwen3.5-nothink": QWEN3_5_NOTHINK, "qwen3.6": QWEN3_6, "qwen3.8": QWEN3_8["xhigh"],
           "qwen3.8-medium": QWEN3_8["medium"],
           "qwen3.8-low": QWEN3_8["low"]}


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    """``ModelFamily.chat``: the version's template by ``model.chat_format``, else Qwen3-VL's ChatML."""
    if model_cfg.chat_format is None:
        return CHATML_VISION_TIMESTAMPED
    return FORMATS[model_cfg.chat_format]


def chat_format_problems(model_cfg: ModelConfig) -> list[str]:
    """``ModelFamily.config_problems``: a ``model.chat_format`` that is not one of the versions'."""
    name = model_cfg.chat_format
    if name is None or name in FORMATS:
        return []
    return [f"model.chat_format='{name}' is not a template of this architecture's versions; set one of "
            f"{' | '.join(FORMATS)}, or null for Qwen3-VL's ChatML."]
