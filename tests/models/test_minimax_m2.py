"""MiniMax-M2 (``MiniMaxM2ForCausalLM`` in the text family): its published config.json read as the ``minimax-m2``
preset and written back, its chat format against its published template's text path, its tokenizer folder named
in one line when missing, and the checks of the q/k norms over all heads (``qk_norm_type: per_layer``). Its
numerics are the ``minimax_m2`` reference's in every concern module (tests/models/references.py)."""

from __future__ import annotations

import dataclasses
import re

import jinja2
import pytest

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.config.validate import check_run_config
from loongforge.convert.families import config_differences
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.data.tokenizer import check_tokenizer
from loongforge.models.registry import get_family
from tests.models.chat_templates import published_template

# MiniMaxAI/MiniMax-M2's config.json (its architecture fields; the serving fields and auto_map left out).
PUBLISHED_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid",
    "shared_intermediate_size": 0, "tie_word_embeddings": False, "use_cache": True, "use_mtp": True,
    "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064, "torch_dtype": "bfloat16",
}

# MiniMaxAI/MiniMax-M2's chat_template.jinja as llama.cpp keeps it (ggml-org/llama.cpp,
# models/templates/unsloth-MiniMax-M2.jinja, Unsloth's copy): ]~!b[ and a system turn always (model_identity where the
# conversation has none), ]~b]user / ]~b]ai turns each ended by [e~[ and a newline, an answer's reasoning kept (in a
# think block) only after the last user turn and only where there is some, the generation prompt opening the
# assistant's thinking.
LLAMA_CPP_TEMPLATE = published_template("minimax-m2-llama.cpp")
# Unsloth's one fix on the text path splits the answer at </think> in a loop, for llama.cpp's engine; under Jinja2
# (HF's apply_chat_template) a loop's sets do not leave it, so the copy would never split. The published template is
# the copy with the split the fix replaced put back (as MiniMax-M2.7's keeps it).
_LOOP_SPLIT = (
    "                {# Unsloth template fixes - must change to for loop since llama.cpp will error out if not #}\n"
    "                {%- set parts = content.split('</think>') %}\n"
    "                {%- for part in parts %}\n"
    "                    {%- if loop.index0 == 0 -%}\n"
    "                        {%- set reasoning_content = part.strip('\\n') %}\n"
    "                        {%- set reasoning_content = (reasoning_content.split('<think>')|last) %}\n"
    "                        {%- set reasoning_content = reasoning_content.strip('\\n') -%}\n"
    "                    {%- else -%}\n"
    "                        {%- set content = part.strip('\\n') %}\n"
    "                    {%- endif %}\n"
    "                {%- endfor %}\n"
)
_SPLIT = (
    "                {%- set reasoning_content = content.split('</think>')[0].strip('\\n').split('<think>')[-1]"
    ".strip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].strip('\\n') %}\n"
)
assert LLAMA_CPP_TEMPLATE.count(_LOOP_SPLIT) == 1
PUBLISHED_TEMPLATE = LLAMA_CPP_TEMPLATE.replace(_LOOP_SPLIT, _SPLIT)
CONVERSATIONS = [
    [Turn("user", "What is 2 + 2?"), Turn("assistant", "4")],
    [Turn("system", "You are terse."), Turn("user", "Hi"), Turn("assistant", "Hello.\n\nHow can I help?"),
     Turn("user", "Name a prime."), Turn("assistant", "7")],
    [Turn("user", "One"), Turn("assistant", "1"), Turn("user", "Two")],
    # Reasoning before the last user turn is dropped, after it kept; an empty block is not written.
    [Turn("user", "2 + 2?"), Turn("assistant", "<think>\nAdd.\n</think>\n\n4\n"), Turn("user", "3 + 3?"),
     Turn("assistant", "<think>Add again.</think>6\n\n"), Turn("assistant", "Add.</think>\nDone")],
    [Turn("user", "Q"), Turn("assistant", "<think>\n\n</think>\n\nA")],
]


def _render(template: str, turns: list[Turn], content_parts: bool = False, prompt: bool = False) -> str:
    messages = (turns_to_hf_messages(turns) if content_parts else
                [{"role": turn.role, "content": turn.text} for turn in turns])
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=prompt)


@pytest.fixture(scope="module")
def chat():
    return get_family("llm").chat(load_run_config("minimax-m2").model)


def test_rendered_text_equals_the_published_template(chat):
    for turns in CONVERSATIONS:
        ours = render_chat(turns, None, chat)
        assert ours.text == _render(PUBLISHED_TEMPLATE, turns)
        assert _render(chat.jinja_template, turns, content_parts=True) == ours.text
        assert (_render(chat.jinja_template, turns, content_parts=True, prompt=True)
                == _render(PUBLISHED_TEMPLATE, turns, prompt=True))
    first = render_chat(CONVERSATIONS[0], None, chat)
    assert first.text == ("]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nWhat is 2 + 2?[e~[\n"
                          "]~b]ai\n4[e~[\n")
    thought = render_chat(CONVERSATIONS[3], None, chat)
    assert thought.text.endswith("]~b]ai\n4[e~[\n]~b]user\n3 + 3?[e~[\n]~b]ai\n<think>\nAdd again.\n</think>\n\n6[e~[\n"
                                 "]~b]ai\n<think>\nAdd.\n</think>\n\nDone[e~[\n")
    # The loss is on every answer as written, its think block included.
    assert [thought.text[a:b] for a, b in thought.label_spans] == [
        "4[e~[", "<think>\nAdd again.\n</think>\n\n6[e~[", "<think>\nAdd.\n</think>\n\nDone[e~["]
    assert [first.text[a:b] for a, b in first.label_spans] == ["4[e~["]


def test_the_published_config_json_is_the_preset_and_is_written_back():
    family = get_family("llm")
    preset = load_run_config("minimax-m2").model
    read = family.config_from_hf(PUBLISHED_CONFIG, "MiniMax-M2/config.json")
    assert config_differences(preset, read) == []
    written = family.config_to_hf(read, "bfloat16")
    unchanged = {key: value for key, value in PUBLISHED_CONFIG.items()
                 if key not in ("mtp_transformer_layers", "num_mtp_modules", "use_mtp", "use_cache")}
    assert {key: written[key] for key in unchanged} == unchanged
    counts = family.count_parameters(preset)
    print(f"\nminimax-m2: {counts['total']:,} parameters, {counts['active']:,} active")
    assert (counts["total"], counts["active"]) == (228_689_748_992, 11_030_537_216)


def test_a_config_transformers_does_not_build_is_refused_in_one_line():
    family = get_family("llm")
    for key, value, named in (("scoring_func", "softmax", "scoring_func='softmax'"),
                              ("shared_intermediate_size", 1536, "shared_intermediate_size=1536"),
                              ("attn_type_list", [0] + [1] * 61, "attn_type_list holds [0, 1]")):
        with pytest.raises(InputError, match=f"^x/config.json: {re.escape(named)}") as error:
            family.config_from_hf({**PUBLISHED_CONFIG, key: value}, "x/config.json")
        assert "\n" not in str(error.value)


def test_the_preset_names_its_tokenizer_download_in_one_line(tmp_path):
    data = load_run_config("minimax-m2").data
    assert (data.tokenizer, data.tokenizer_repo) == ("tokenizers/MiniMax-M2", "MiniMaxAI/MiniMax-M2")
    with pytest.raises(InputError, match=r"^data.tokenizer='tokenizers/MiniMax-M2' is no folder: download "
                                         r"MiniMaxAI/MiniMax-M2's tokenizer files there") as error:
        check_tokenizer(data.tokenizer, data.tokenizer_repo)
    assert "\n" not in str(error.value)


def test_q_k_norms_over_all_heads_are_checked():
    cfg = load_run_config("minimax-m2-tiny")
    language = cfg.model.language

    def problems(**changes) -> list[str]:
        parallel = dataclasses.replace(cfg.parallel, **changes.pop("parallel", {}))
        return check_run_config(dataclasses.replace(cfg, parallel=parallel,
                                            model=dataclasses.replace(cfg.model, language=dataclasses.replace(
                                                language, **changes))))

    assert not [line for line in problems() if "qk_norm" in line]
    tp4 = [line for line in problems(parallel=dict(tensor_model_parallel_size=4, world_size=4)) if "qk_norm" in line]
    assert tp4 == ["parallel.tensor_model_parallel_size=4 does not divide model.language.num_query_groups=2 with "
                   "model.language.qk_norm_type=per_layer (the key norm spans the key heads, each on one rank); use "
                   "one of 1, 2."]
    without_norm = " ".join(problems(qk_norm=False))
    assert "model.language.qk_norm_type=per_layer needs model.language.qk_norm: true" in without_norm
    assert "model.language.qk_norm_type='per_group' must be one of per_head, per_layer." in problems(
        qk_norm_type="per_group")


def test_the_published_size_plans_to_fit_80gb_gpus():
    """minimax-m2's dry run: 62 layers over PP 4 (15 | 16 | 16 | 15), EP 64 (4 of every layer's 256 experts a rank),
    TP 1, full recompute; every stage's parameters per rank, and the plan fits at CP 1."""
    from typer.testing import CliRunner

    from loongforge.cli.app import app

    out = CliRunner().invoke(app, ["train", "--preset", "minimax-m2", "--dry-run"]).stdout
    plan = out.split("parallel plan\n")[1]
    assert "256 processes = TP1 x PP4 x DP64" in plan and "EP64 x expert TP1 x expert DP1" in plan
    assert "228.69B total (228,689,748,992), 11.03B active per token" in plan
    lang = load_run_config("minimax-m2").model.language
    h, channels, experts = lang.hidden_size, lang.head_dim, lang.moe.num_experts
    heads, groups = lang.num_attention_heads, lang.num_query_groups
    # q, k, v, o and the q/k norms' weight per channel
    attention = h * (heads + 2 * groups) * channels + heads * channels * h + (heads + groups) * channels
    layer = attention + 2 * h + experts * h + 3 * h * lang.moe.ffn_hidden_size * experts // 64  # norms, router
    embedding = lang.vocab_size * h
    stages = [15 * layer + embedding, 16 * layer, 16 * layer, 15 * layer + embedding + h]
    for stage, params in zip(("layers 0-14 (15) + embeddings", "layers 15-30 (16)", "layers 47-61 (15) + LM head"),
                             (stages[0], stages[1], stages[3])):
        assert f"{stage}: {params / 1e9:.2f}B params per rank" in plan, stage
    cp1 = next(line for line in out.splitlines() if line.strip().startswith("1  TP1 x PP4 x DP64"))
    total = float(cp1.split()[-2])
    print(f"\nminimax-m2: stages {[round(x / 1e9, 2) for x in stages]}B params per rank; CP 1 plan {total} GiB a rank")
    assert cp1.split()[-1] == "yes" and total <= 72.0
