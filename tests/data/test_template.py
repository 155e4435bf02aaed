"""Chat rendering equals apply_chat_template; labels cover only assistant answers."""

import numpy as np
import pytest
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.models.registry import get_family
from tests.data.conftest import LLAMAFACTORY, LOONGFORGE_VLM, require

DEMO_FILES = [
    LLAMAFACTORY / "mllm_demo.json",
    LLAMAFACTORY / "mllm_video_demo.json",
    LLAMAFACTORY / "v1_multimodal_demo.jsonl",
    LOONGFORGE_VLM / "mix.json",
    LOONGFORGE_VLM / "mllm_demo.json",
]
SYSTEM = "You are a helpful assistant."
CHAT = get_family("qwen2_5_vl").chat


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
    return SampleMeasurer(tokenizer, DataConfig(seq_len=100_000), ModelConfig())


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
