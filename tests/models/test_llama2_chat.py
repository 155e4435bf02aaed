"""Llama 2's chat format (``model.chat_format: llama2``, the Llama 2 presets): ``data.template`` and the format's
Jinja twin render what Llama 2's published chat template (Llama-2-7b-chat-hf's tokenizer_config.json, written
here, not fetched) renders; its SentencePiece tokenizer ships in no package, so a preset without the local
folder stops in one line naming the download."""

from __future__ import annotations

import jinja2
import pytest

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.data.tokenizer import check_tokenizer
from loongforge.models.registry import get_family

# Llama-2-7b-chat-hf's tokenizer_config.json chat_template (bos_token <s>, eos_token </s>).
PUBLISHED = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
SYSTEM = "You are a careful assistant.\nAnswer briefly."
CONVERSATIONS = [
    [Turn("user", "What is 2 + 2?"), Turn("assistant", "4")],
    [Turn("system", SYSTEM), Turn("user", "Hi"), Turn("assistant", "Hello.\n\nHow can I help?"),
     Turn("user", "  Name a prime.\n"), Turn("assistant", " 7 ")],
    [Turn("user", "One"), Turn("assistant", "1"), Turn("user", "Two"), Turn("assistant", "2"),
     Turn("user", "Three")],
]


def _render(template: str, turns: list[Turn], content_parts: bool = False) -> str:
    def raise_exception(message):
        raise ValueError(message)

    messages = (turns_to_hf_messages(turns) if content_parts else
                [{"role": turn.role, "content": turn.text} for turn in turns])
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, bos_token="<s>", eos_token="</s>",
                                                     raise_exception=raise_exception, add_generation_prompt=False)


@pytest.fixture(scope="module")
def chat():
    return get_family("llm").chat(load_run_config("llama2-7b").model)


def test_rendered_text_equals_the_published_template(chat):
    for turns in CONVERSATIONS:
        ours = render_chat(turns, None, chat)
        assert ours.text == _render(PUBLISHED, turns)
        assert _render(chat.jinja_template, turns, content_parts=True) == ours.text
    first = render_chat(CONVERSATIONS[1], None, chat).text
    assert first.startswith(f"<s>[INST] <<SYS>>\n{SYSTEM}\n<</SYS>>\n\nHi [/INST] Hello.")
    assert first.endswith("</s><s>[INST] Name a prime. [/INST] 7 </s>")


def test_a_system_prompt_from_the_data_settings_joins_the_first_instruction(chat):
    turns = CONVERSATIONS[0]
    ours = render_chat(turns, "Be terse.", chat).text
    assert ours == _render(PUBLISHED, [Turn("system", "Be terse."), *turns])
    assert render_chat(turns, None, chat).text == "<s>[INST] What is 2 + 2? [/INST] 4 </s>"  # no default prompt


def test_labels_are_the_answers_and_their_end(chat):
    rendered = render_chat(CONVERSATIONS[1], None, chat)
    assert [rendered.text[a:b] for a, b in rendered.label_spans] == ["Hello.\n\nHow can I help? </s>", "7 </s>"]
    assert chat.markers == ("<s>", "</s>")  # [INST] and <<SYS>> are text to its SentencePiece tokenizer


def test_every_llama2_preset_names_its_tokenizer_download_in_one_line():
    for name in ("llama2-7b", "llama2-13b", "llama2-70b"):
        data = load_run_config(name).data
        with pytest.raises(InputError) as error:
            check_tokenizer(data.tokenizer, data.tokenizer_repo)
        message = str(error.value)
        print(f"\n{name}: {message}")
        assert "\n" not in message and data.tokenizer_repo in message and "meta-llama/Llama-2-" in message
