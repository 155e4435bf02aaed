"""Chat rendering equals apply_chat_template (Qwen2.5-VL's ChatML, Llama 3's headers); labels cover
only assistant answers."""

import itertools
import json

import numpy as np
import pytest
from PIL import Image

from loongforge.config.loader import load_run_config
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.models.registry import get_family
from tests.data.conftest import LLAMAFACTORY, LOONGFORGE_VLM, SHARED_DATA, require

DEMO_FILES = [
    LLAMAFACTORY / "mllm_demo.json",
    LLAMAFACTORY / "mllm_video_demo.json",
    LLAMAFACTORY / "v1_multimodal_demo.jsonl",
    LOONGFORGE_VLM / "mix.json",
    LOONGFORGE_VLM / "mllm_demo.json",
]
SYSTEM = "You are a helpful assistant."
CHAT = get_family("qwen2_5_vl").chat(ModelConfig(family="qwen2_5_vl"))


def _demo_samples():
    return [FileSamples([str(require(path))]).get(i) for path in DEMO_FILES
            for i in range(len(FileSamples([str(path)])))]


def test_rendered_text_equals_apply_chat_template(tokenizer):
    samples = _demo_samples()
    assert len(samples) == 45 and all(isinstance(s, ConversationSample) for s in samples)
    extra = [
        [Turn("system", "Be brief."), Turn("user", "Hi"), Turn("assistant", "Hello!")],
        [Turn("user", "<image>\n<video>Compare."), Turn("assistant", "  spaced  \n\nanswer ")],
    ]
    for turns in [s.turns for s in samples] + extra:
        ours = render_chat(turns, SYSTEM, CHAT).text
        assert ours == tokenizer.apply_chat_template(turns_to_hf_messages(turns), tokenize=False)


def test_template_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.chat_template == CHAT.jinja_template


@pytest.fixture(scope="module")
def measurer(tokenizer):
    return SampleMeasurer(tokenizer, DataConfig(seq_len=100_000), ModelConfig(family="qwen2_5_vl"))


def test_labels_only_on_assistant_answers(tokenizer, measurer):
    for sample in _demo_samples():
        measured = measurer.measure(sample)
        answers = [t.text for t in sample.turns if t.role == "assistant"]
        labelled = measured.input_ids[measured.is_answer]
        # Decoding the labelled tokens gives exactly each answer followed by <|im_end|>.
        assert tokenizer.decode(labelled) == "".join(a + "<|im_end|>" for a in answers)
        # Each labelled run starts right after "<|im_start|>assistant\n".
        starts = np.flatnonzero(np.diff(np.r_[0, measured.is_answer.astype(int)]) == 1)
        header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        for start in starts:
            assert measured.input_ids[start - len(header):start].tolist() == header


def test_token_ids_equal_transformers_processing(tokenizer, measurer):
    """Our ids == tokenize(apply_chat_template) with each <|image_pad|> expanded to grid.prod()//4
    as the HF processor does, with grids from transformers' image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf_images = Qwen2VLImageProcessorPil()
    for sample in _demo_samples():
        if sample.videos or not sample.images:
            continue
        grids = hf_images(images=[Image.open(p) for p in sample.images], return_tensors="np")["image_grid_thw"]
        text = tokenizer.apply_chat_template(turns_to_hf_messages(sample.turns), tokenize=False)
        chunks = text.split("<|image_pad|>")
        expanded = chunks[0] + "".join("<|image_pad|>" * (int(g.prod()) // 4) + c for g, c in zip(grids, chunks[1:]))
        expected = tokenizer(expanded, add_special_tokens=False)["input_ids"]
        assert measurer.measure(sample).input_ids.tolist() == expected


def test_answer_starting_with_newlines_keeps_prompt_unlabelled(tokenizer, measurer):
    sample = ConversationSample("t:1", "t", 1, [Turn("user", "Q"), Turn("assistant", "\n\nA")])
    measured = measurer.measure(sample)
    text = render_chat(sample.turns, SYSTEM, CHAT).text
    assert measured.input_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    # Whatever BPE merged across the boundary is not labelled: labels never include the header.
    assert "assistant" not in tokenizer.decode(measured.input_ids[measured.is_answer])
    assert tokenizer.decode(measured.input_ids[measured.is_answer]).endswith("A<|im_end|>")


# ---------------------------------------------------------------- Llama 3 (llm family, Llama architecture)

LLAMA_MODEL = load_run_config("llama-tiny").model
LLAMA_CHAT = get_family("llm").chat(LLAMA_MODEL)
LLAMA_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _llama_conversations() -> list[list[Turn]]:
    """Real long text (arena-hard prompts with o3-mini's answers), the text-only demo samples, and
    a system turn, several turns and whitespace at both ends of an answer."""
    answers = require(SHARED_DATA / "arena_hard" / "v2.0_model_answer_o3-mini-2025-01-31.jsonl")
    with open(answers, encoding="utf-8") as f:
        records = [json.loads(line) for line in itertools.islice(f, 12)]
    conversations = [[Turn("user", r["messages"][0]["content"]), Turn("assistant", r["messages"][1]["content"]["answer"])]
                     for r in records]
    conversations += [s.turns for s in _demo_samples() if not s.images and not s.videos]
    return conversations + [
        [Turn("system", "Be brief."), Turn("user", "Hi"), Turn("assistant", "Hello!")],
        [Turn("user", "2 + 2?"), Turn("assistant", "4"), Turn("user", "And 3 + 3?"), Turn("assistant", " 6 ")],
        [Turn("user", "Spaces?"), Turn("assistant", "  spaced  \n\nanswer \n")],
    ]


def test_llama_format_is_chosen_by_architecture():
    assert LLAMA_CHAT.text_start == "<|begin_of_text|>" and LLAMA_CHAT.turn_end == "<|eot_id|>"
    assert get_family("llm").chat(load_run_config("llama3.1-8b").model) == LLAMA_CHAT
    assert get_family("llm").chat(load_run_config("llm-tiny").model).turn_end == "<|im_end|>"  # Qwen3
    turns = [Turn("user", "Hi"), Turn("assistant", "Hello!")]
    assert render_chat(turns, SYSTEM, LLAMA_CHAT).text == (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>")


def test_llama_rendered_text_equals_apply_chat_template(llama_tokenizer):
    conversations = _llama_conversations()
    assert len(conversations) == 12 + 1 + 3  # one text-only demo sample (in mix.json)
    for turns in conversations:
        ours = render_chat(turns, SYSTEM, LLAMA_CHAT).text
        assert ours == llama_tokenizer.apply_chat_template(turns_to_hf_messages(turns), tokenize=False)
    text = llama_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" + LLAMA_HEADER)


@pytest.fixture(scope="module")
def llama_measurer(llama_tokenizer):
    return SampleMeasurer(llama_tokenizer, DataConfig(seq_len=100_000, tokenizer="llama3"), LLAMA_MODEL)


def test_llama_token_ids_equal_apply_chat_template_and_labels_are_the_answers(llama_tokenizer, llama_measurer):
    header = llama_tokenizer(LLAMA_HEADER, add_special_tokens=False)["input_ids"]
    for k, turns in enumerate(_llama_conversations()):
        measured = llama_measurer.measure(ConversationSample(f"t:{k}", "t", k, turns))
        expected = llama_tokenizer.apply_chat_template(turns_to_hf_messages(turns), tokenize=True, return_dict=False)
        assert measured.input_ids.tolist() == expected
        assert expected[0] == 128000 and expected.count(128000) == 1
        # The labelled tokens decode to exactly each answer followed by <|eot_id|>, one run per
        # answer, each right after the assistant header.
        answers = [t.text for t in turns if t.role == "assistant"]
        assert llama_tokenizer.decode(measured.input_ids[measured.is_answer]) == "".join(a + "<|eot_id|>" for a in answers)
        starts = np.flatnonzero(np.diff(np.r_[0, measured.is_answer.astype(int)]) == 1)
        assert len(starts) == len(answers)
        for start in starts:
            assert measured.input_ids[start - len(header):start].tolist() == header
        ends = np.flatnonzero(np.diff(np.r_[measured.is_answer.astype(int), 0]) == -1)
        assert (measured.input_ids[ends] == llama_tokenizer.convert_tokens_to_ids("<|eot_id|>")).all()


def test_llama_answer_starting_with_newlines_keeps_the_header_unlabelled(llama_tokenizer, llama_measurer):
    sample = ConversationSample("t:1", "t", 1, [Turn("user", "Q"), Turn("assistant", "\n\nA")])
    measured = llama_measurer.measure(sample)
    text = render_chat(sample.turns, SYSTEM, LLAMA_CHAT).text
    assert measured.input_ids.tolist() == llama_tokenizer(text, add_special_tokens=False)["input_ids"]
    labelled = llama_tokenizer.decode(measured.input_ids[measured.is_answer])
    assert "<|end_header_id|>" not in labelled and labelled.endswith("A<|eot_id|>")


# ---------------------------------------------------------------- Qwen3 (thinking) and Qwen3-VL

QWEN3_MODEL = load_run_config("llm-tiny").model  # Qwen3 architecture
QWEN3_CHAT = get_family("llm").chat(QWEN3_MODEL)
QWEN3_VL_CHAT = get_family("qwen3_vl").chat(load_run_config("qwen3vl-tiny").model)


def _qwen3_conversations() -> list[list[Turn]]:
    """Text conversations, plus reasoning in every place Qwen3's template treats differently."""
    return _llama_conversations() + [
        [Turn("user", "2 + 2?"), Turn("assistant", "<think>\nAdd them.\n</think>\n\n4")],
        [Turn("user", "2 + 2?"), Turn("assistant", "Add them.</think>4")],  # no opening tag
        [Turn("user", "2 + 2?"), Turn("assistant", "<think>\nAdd.\n</think>\n\n4"),  # dropped: not the last
         Turn("user", "And 3 + 3?"), Turn("assistant", "<think>\n\nAdd again.\n\n</think>\n\n\n6")],
        [Turn("system", "Think."), Turn("user", "Hi"), Turn("assistant", "Hello"), Turn("assistant", "<think>x</think>Bye")],
    ]


def test_qwen3_writes_an_empty_think_block_in_the_last_answer_and_no_default_system_turn():
    # Qwen3's own template on a plain exchange (the reference text, not our Jinja twin).
    turns = [Turn("user", "2 + 2?"), Turn("assistant", "4"), Turn("user", "3 + 3?"), Turn("assistant", "6")]
    assert render_chat(turns, None, QWEN3_CHAT).text == (
        "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3 + 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n")
    reasoned = [Turn("user", "2 + 2?"), Turn("assistant", "<think>\nAdd.\n</think>\n\n4"),
                Turn("user", "3 + 3?"), Turn("assistant", "6")]
    assert render_chat(reasoned, None, QWEN3_CHAT).text == render_chat(turns, None, QWEN3_CHAT).text
    assert render_chat(turns, "Be brief.", QWEN3_CHAT).text.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_qwen3_rendered_text_equals_apply_chat_template(qwen3_tokenizer):
    for turns in _qwen3_conversations():
        ours = render_chat(turns, None, QWEN3_CHAT).text
        assert ours == qwen3_tokenizer.apply_chat_template(turns_to_hf_messages(turns), tokenize=False)


def test_qwen3_tokenizer_has_its_think_tokens_and_labels_cover_the_think_block(qwen3_tokenizer, tokenizer):
    ids = {token: qwen3_tokenizer.convert_tokens_to_ids(token)
           for token in ("<tool_response>", "</tool_response>", "<think>", "</think>")}
    assert ids == {"<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
    assert len(tokenizer("<think>", add_special_tokens=False)["input_ids"]) > 1  # Qwen2.5's has none
    measurer = SampleMeasurer(qwen3_tokenizer, DataConfig(seq_len=100_000, tokenizer="qwen3"), QWEN3_MODEL)
    for k, turns in enumerate(_qwen3_conversations()):
        measured = measurer.measure(ConversationSample(f"t:{k}", "t", k, turns))
        expected = qwen3_tokenizer.apply_chat_template(turns_to_hf_messages(turns), tokenize=True, return_dict=False)
        assert measured.input_ids.tolist() == expected
    measured = measurer.measure(ConversationSample("t", "t", 0, [Turn("user", "Q"), Turn("assistant", "A")]))
    assert qwen3_tokenizer.decode(measured.input_ids[measured.is_answer]) == "<think>\n\n</think>\n\nA<|im_end|>"
    with pytest.raises(ValueError, match=r"data.tokenizer=qwen splits <think>, a marker of the model's chat format"):
        SampleMeasurer(tokenizer, DataConfig(seq_len=4096, tokenizer="qwen"), QWEN3_MODEL)


def test_system_prompt_unset_is_the_models_default_and_empty_is_none():
    turns = [Turn("user", "<image>Hi"), Turn("assistant", "Hello!")]
    qwen3_vl = render_chat(turns, None, QWEN3_VL_CHAT).text
    assert qwen3_vl.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi")
    assert render_chat(turns, None, CHAT).text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    assert render_chat(turns, "", CHAT).text == render_chat(turns, None, QWEN3_VL_CHAT).text
    assert DataConfig().system_prompt is None
