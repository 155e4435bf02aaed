"""The chat templates of Qwen3.5's versions (``models/qwen3_5/chat.py``): for each name ``model.chat_format``
takes, our rendering (``data.template`` with the version's ``ChatFormat``) equals the published template, written
here as the Hub ships it (facts of the models; never fetched), rendered by transformers' ``apply_chat_template`` on
the Qwen tokenizer loongforge builds (``data.tokenizer=qwen3``): the text of conversations with images, reasoning,
a system turn or ``data.system_prompt``, and surrounding whitespace; the token ids and the labels of the data
path; and the format's own Jinja twin renders the same, generation prompt included. Videos: the family writes a
bare video pad that the data side expands per frame after its timestamp, as Qwen3-VL's processor expands the
template's (``tests/data/test_qwen3_video.py``)."""

from __future__ import annotations

import pytest

from loongforge.config.loader import load_run_config
from loongforge.config.schema import DataConfig
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.qwen3_5.chat import FORMATS
from loongforge.models.qwen_vl.chatml import CHATML_VISION_TIMESTAMPED
from loongforge.models.registry import get_family
from tests.models.chat_templates import published_template

# Qwen3.5's chat_template.jinja as Qwen3.5-4B and larger ship it (huggingface/trl,
# trl/chat_templates/qwen3_5_think.jinja, kept there byte for byte to recognise the model): Qwen3.6's below without
# preserve_thinking.
QWEN3_5 = published_template("qwen3.5")
# As Qwen3.5-2B and smaller ship it (trl/chat_templates/qwen3_5_nothink.jinja): only the generation prompt's default
# differs, the empty block unless a caller sets enable_thinking=True.
_THINK_PROMPT = r"""    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}"""
QWEN3_5_NOTHINK = QWEN3_5.replace(_THINK_PROMPT, r"""    {%- if enable_thinking is defined and enable_thinking is true %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}""")
assert QWEN3_5_NOTHINK != QWEN3_5

# Qwen/Qwen3.6-27B's and Qwen/Qwen3.6-35B-A3B's chat_template.jinja.
QWEN3_6 = published_template("qwen3.6")

# Qwen/Qwen3.8-27B's chat_template.jinja: reasoning_effort (xhigh by default) and preserve_thinking (on by default).
QWEN3_8 = published_template("qwen3.8")

# model.chat_format -> (the published template, its keyword arguments that name the same rendering)
PUBLISHED = {"qwen3.5": (QWEN3_5, {}), "qwen3.5-nothink": (QWEN3_5_NOTHINK, {}), "qwen3.6": (QWEN3_6, {}),
             "qwen3.8": (QWEN3_8, {}),
             "qwen3.8-medium": (QWEN3_8, {"reasoning_effort": "medium"}),
             "qwen3.8-low": (QWEN3_8, {"reasoning_effort": "low"})}

CONVERSATIONS = [
    [Turn("user", "<image>Who is he?"), Turn("assistant", "Thomas Muller.")],
    [Turn("system", "Be brief."), Turn("user", "2 + 2?"), Turn("assistant", "<think>\nAdd them.\n</think>\n\n4")],
    [Turn("user", "2 + 2?"), Turn("assistant", "<think>\nAdd.\n</think>\n\n4"),  # before the last user turn
     Turn("user", "<image><image>And these?"), Turn("assistant", "Two cats.")],
    [Turn("user", "Hi"), Turn("assistant", "Hello"), Turn("assistant", "<think>x</think>Bye")],
    [Turn("user", "  padded question \n"), Turn("assistant", "\n answer with spaces  ")],
    [Turn("user", "2 + 2?"), Turn("assistant", "Add.</think>4")],  # no opening tag
    [Turn("system", "  "), Turn("user", "Q"), Turn("assistant", "<think>\n\n</think>\n\nA")],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("qwen3")


def _published_messages(turns: list[Turn], system_prompt: str | None, name: str) -> list[dict]:
    """The conversation as a caller hands it to the published template: ``data.system_prompt`` as a leading system
    message; for Qwen3.8, whose template reads an assistant's reasoning from ``reasoning_content`` alone, the
    reasoning before ``</think>`` moved there."""
    messages = turns_to_hf_messages(turns)
    if system_prompt and turns[0].role != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not name.startswith("qwen3.8"):
        return messages
    for message in messages:
        if message["role"] == "assistant":
            text = "".join(part["text"] for part in message["content"])
            reasoning = ""
            if "</think>" in text:
                reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                text = text.split("</think>")[-1].lstrip("\n")
            message.update(content=text, reasoning_content=reasoning)
    return messages


@pytest.mark.parametrize("name", FORMATS)
def test_our_rendering_equals_the_published_template(tokenizer, name):
    chat, (template, kwargs) = FORMATS[name], PUBLISHED[name]
    for turns in CONVERSATIONS:
        for system_prompt in (None, "Answer in English."):
            ours = render_chat(turns, system_prompt, chat).text
            published = tokenizer.apply_chat_template(_published_messages(turns, system_prompt, name),
                                                      chat_template=template, tokenize=False, **kwargs)
            assert ours == published, (turns, system_prompt)
            messages = _published_messages(turns, system_prompt, "ours")
            assert tokenizer.apply_chat_template(messages, chat_template=chat.jinja_template, tokenize=False) == ours
    user, system = {"role": "user", "content": "Q"}, {"role": "system", "content": "S"}
    for question in ([user], [system, user]):
        for thinking in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
            prompt = tokenizer.apply_chat_template(question, chat_template=template, tokenize=False,
                                                   add_generation_prompt=True, **kwargs, **thinking)
            assert tokenizer.apply_chat_template(question, chat_template=chat.jinja_template, tokenize=False,
                                                 add_generation_prompt=True, **thinking) == prompt


@pytest.mark.parametrize("preset", ["qwen3.6-tiny", "qwen3.8-tiny"])
def test_the_data_path_tokenizes_the_presets_template_and_labels_its_answers(tokenizer, preset):
    model_cfg = load_run_config(preset).model
    chat = get_family(model_cfg.family).chat(model_cfg)
    template, kwargs = PUBLISHED[model_cfg.chat_format]
    measurer = SampleMeasurer(tokenizer, DataConfig(seq_len=100_000, tokenizer="qwen3"), model_cfg)
    texts = [turns for turns in CONVERSATIONS if "<image>" not in "".join(turn.text for turn in turns)]
    for k, turns in enumerate(texts):
        measured = measurer.measure(ConversationSample(f"t:{k}", "t", k, turns))
        expected = tokenizer.apply_chat_template(_published_messages(turns, None, model_cfg.chat_format),
                                                 chat_template=template, tokenize=True, return_dict=False, **kwargs)
        assert measured.input_ids.tolist() == expected
    turns = [Turn("user", "Q"), Turn("assistant", "<think>R</think>A"), Turn("user", "Q2"), Turn("assistant", "B")]
    measured = measurer.measure(ConversationSample("t", "t", 0, turns))
    answers = tokenizer.decode(measured.input_ids[measured.is_answer])
    # Qwen3.6 drops the reasoning of an answer before the last question; Qwen3.8 keeps it.
    first = "<think>\nR\n</think>\n\nA" if model_cfg.chat_format == "qwen3.8" else "A"
    assert answers == f"{first}<|im_end|><think>\n\n</think>\n\nB<|im_end|>"
    assert chat is FORMATS[model_cfg.chat_format]


def test_the_family_without_a_version_keeps_qwen3_vls_chatml_and_refuses_another_familys_format():
    family = get_family("qwen3_5")
    assert family.chat(load_run_config("qwen3.5-tiny").model) is CHATML_VISION_TIMESTAMPED
    # The published presets render their checkpoints' own templates (2B and smaller: thinking off by default).
    for preset, name in (("qwen3.5-0.8b", "qwen3.5-nothink"), ("qwen3.5-9b", "qwen3.5"), ("qwen3.5-27b", "qwen3.5"),
                         ("qwen3.5-35b-a3b", "qwen3.5"), ("qwen3.5-397b-a17b", "qwen3.5"), ("qwen3.6-27b", "qwen3.6")):
        assert family.chat(load_run_config(preset).model) is FORMATS[name], preset
    problems = family.config_problems(load_run_config("qwen3.6-tiny", overrides=["model.chat_format=qwen3"]).model)
    assert problems == ["model.chat_format='qwen3' is not a template of this architecture's versions; set one of "
                        "qwen3.5 | qwen3.5-nothink | qwen3.6 | qwen3.8 | qwen3.8-medium | qwen3.8-low, or null for "
                        "Qwen3-VL's ChatML."]
