"""Qwen3-Next (``Qwen3NextForCausalLM``, the text family's hybrid architecture): the published config.json of
Qwen/Qwen3-Next-80B-A3B-Instruct, written here as the Hub ships it (facts of the model; never fetched), reads as the
``qwen3-next-80b-a3b`` preset's model, the layer pattern from ``full_attention_interval`` alone; a layer pattern of
dense MLP layers loongforge does not build is refused in one line; the Hub checkpoints' multi-token-prediction head
(``mtp.*``), which transformers' class has no module for either, is noted as not read; the chat format the
architecture chooses renders what Qwen3-Next-80B-A3B-Instruct's published template renders (text, token ids, the
Jinja twin), and ``model.chat_format: qwen3`` what Qwen3-Next-80B-A3B-Thinking's renders for training. The model's
math at TP 1 / TP 2, LoRA, the round trip and the counts: the concern modules over ``references.REFERENCES``
(``qwen3_next``) and every preset; context parallelism: ``tests/train/test_qwen3_next_train.py``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.convert.engine import check_hf_tensors, unread_note
from loongforge.convert.families import config_differences
from loongforge.convert.hf_io import HFCheckpoint
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.registry import get_family
from tests.models.references import REFERENCES
from tests.models.chat_templates import published_template

FAMILY = get_family("llm")
# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (48 layers and Qwen3's 151,936-row vocabulary as its model card
# states them).
PUBLISHED_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct's chat template (tokenizer_config.json): ChatML, no default system turn, no think
# block (the model answers without reasoning).
INSTRUCT_TEMPLATE = published_template("qwen3-next-instruct")
# Qwen/Qwen3-Next-80B-A3B-Thinking's: Qwen3's reasoning blocks, and its generation prompt opens one.
THINKING_TEMPLATE = published_template("qwen3-next-thinking")
CONVERSATIONS = [
    [Turn("user", "What is 2 + 2?"), Turn("assistant", "4")],
    [Turn("system", "You are terse."), Turn("user", "Hi"), Turn("assistant", "Hello.\n\nHow can I help?"),
     Turn("user", "  Name a prime.\n"), Turn("assistant", " 7 ")],
    [Turn("user", "One"), Turn("assistant", "<think>\ncount\n</think>\n\n1"), Turn("user", "Two"),
     Turn("assistant", "<think>add one</think>2")],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("qwen3")


def test_the_published_config_reads_as_the_preset():
    model_cfg = FAMILY.config_from_hf(PUBLISHED_CONFIG, "Qwen3-Next-80B-A3B-Instruct/config.json")
    preset = load_run_config("qwen3-next-80b-a3b").model
    assert config_differences(preset, model_cfg) == []
    assert model_cfg.language.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 12
    written = FAMILY.config_to_hf(preset)
    assert {key: written[key] for key in ("partial_rotary_factor", "shared_expert_intermediate_size",
                                          "num_experts_per_tok", "linear_num_value_heads")} == {
        "partial_rotary_factor": 0.25, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
        "linear_num_value_heads": 32}


@pytest.mark.parametrize("key, value", [("decoder_sparse_step", 2), ("mlp_only_layers", [0]),
                                        ("shared_expert_intermediate_size", 0)])
def test_a_layer_pattern_loongforge_does_not_build_is_refused_in_one_line(key, value):
    with pytest.raises(InputError) as error:
        FAMILY.config_from_hf({**PUBLISHED_CONFIG, key: value}, "config.json")
    message = str(error.value)
    print(f"\n{key}={value}: {message}")
    assert "\n" not in message and message.startswith("config.json: ") and key in message


def test_the_multi_token_prediction_head_is_noted_not_read(tmp_path):
    """The folder's tensors under ``mtp.`` are counted and left (``convert`` prints the note); every other tensor is
    the model's, and a stray one elsewhere is still refused."""
    REFERENCES["qwen3_next"].save_hf(tmp_path, small_vocabulary=True)
    save_file({"mtp.fc.weight": torch.zeros(4, 4), "mtp.norm.weight": torch.zeros(4),
               "mtp.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 4)}, str(tmp_path / "mtp.safetensors"))
    checkpoint = HFCheckpoint(tmp_path)
    model_cfg = checkpoint.model_config()
    check_hf_tensors(checkpoint, model_cfg, "its config.json")
    assert unread_note(checkpoint, model_cfg) == ["3 tensors under mtp. not read (no place for them in this model)"]
    save_file({"model.stray.weight": torch.zeros(2)}, str(tmp_path / "stray.safetensors"))
    with pytest.raises(InputError, match="unexpected tensor model.stray.weight"):
        check_hf_tensors(HFCheckpoint(tmp_path), model_cfg, "its config.json")


def _messages(turns: list[Turn]) -> list[dict]:
    return [{"role": turn.role, "content": turn.text} for turn in turns]


def test_the_architectures_chat_format_renders_the_instruct_template(tokenizer):
    chat = FAMILY.chat(load_run_config("qwen3-next-80b-a3b").model)
    assert chat.default_system_prompt is None and not chat.thinking
    for turns in CONVERSATIONS:
        ours = render_chat(turns, None, chat)
        published = tokenizer.apply_chat_template(_messages(turns), chat_template=INSTRUCT_TEMPLATE, tokenize=False)
        assert ours.text == published
        assert tokenizer.apply_chat_template(turns_to_hf_messages(turns), chat_template=chat.jinja_template,
                                             tokenize=False) == published
        assert tokenizer.encode(ours.text) == tokenizer.apply_chat_template(
            _messages(turns), chat_template=INSTRUCT_TEMPLATE, tokenize=True, return_dict=False)
    question = [{"role": "user", "content": "Q"}]
    assert tokenizer.apply_chat_template(question, chat_template=chat.jinja_template, tokenize=False,
                                         add_generation_prompt=True) == tokenizer.apply_chat_template(
        question, chat_template=INSTRUCT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    # data.system_prompt: the conversation's first turn, as a system message handed to the template.
    assert render_chat(CONVERSATIONS[0], "Be brief.", chat).text == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *_messages(CONVERSATIONS[0])], chat_template=INSTRUCT_TEMPLATE,
        tokenize=False)
    rendered = render_chat(CONVERSATIONS[1], None, chat)
    assert [rendered.text[a:b] for a, b in rendered.label_spans] == ["Hello.\n\nHow can I help?<|im_end|>",
                                                                     " 7 <|im_end|>"]


def test_qwen3s_format_renders_the_thinking_template_for_training(tokenizer):
    chat = FAMILY.chat(load_run_config("qwen3-next-80b-a3b", overrides=["model.chat_format=qwen3"]).model)
    for turns in CONVERSATIONS:
        published = tokenizer.apply_chat_template(_messages(turns), chat_template=THINKING_TEMPLATE, tokenize=False)
        assert render_chat(turns, None, chat).text == published


def test_qwen3_5s_dense_decoder_reads_and_writes_as_a_text_model():
    """``Qwen3_5ForCausalLM`` (Qwen3.5's decoder without its tower, tied, a dense MLP in every layer): the config.json
    loongforge writes builds transformers' class on the meta device with the parameters and HF tensor shapes loongforge
    counts, and reads back as the same model. (Its math is the qwen3_5 reference's decoder and, as a text model,
    ``qwen3_5_moe_text``'s.)"""
    import transformers

    published = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 64,
                 "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 32, "vocab_size": 300, "tie_word_embeddings": True, "full_attention_interval": 2,
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                 "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2], "mrope_interleaved": True}}
    model_cfg = FAMILY.config_from_hf(published, "config.json")
    lang = model_cfg.language
    assert (lang.moe, lang.layer_types, lang.partial_rotary_factor) == (
        None, ["linear_attention", "full_attention"] * 2, 0.25)
    written = FAMILY.config_to_hf(model_cfg, "float32")
    assert config_differences(model_cfg, FAMILY.config_from_hf(written, "config.json")) == []
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**written))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert FAMILY.count_parameters(model_cfg)["total"] == sum(p.numel() for p in model.parameters())
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items() if key != "lm_head.weight"}
    assert FAMILY.hf_shapes(model_cfg) == shapes


def test_layers_the_stated_architecture_does_not_have_are_refused_in_one_line():
    """Qwen3-Next's class always has zero-centred norms and gated attention; Qwen3.5-MoE's router always
    renormalises."""
    model_cfg = load_run_config("qwen3-next-tiny", overrides=["model.language.zero_centered_norms=false"]).model
    (problem,) = FAMILY.config_problems(model_cfg)
    print(f"\n{problem}")
    assert problem.startswith("model.language.architecture=Qwen3NextForCausalLM but model.language has layer_types "
                              "set with attention_output_gate and zero_centered_norms: false;")
    model_cfg = load_run_config("qwen3-next-tiny", overrides=["model.language.architecture=Qwen3_5MoeForCausalLM",
                                                              "model.language.moe.norm_topk_prob=false"]).model
    assert FAMILY.config_problems(model_cfg) == [
        "model.language.architecture=Qwen3_5MoeForCausalLM but model.language has moe.norm_topk_prob: false; "
        "Qwen3_5MoeForCausalLM has add_qkv_bias: false, qk_norm: true, moe set: true, "
        "multi_latent_attention set: false, layer_types set with attention_output_gate and zero_centered_norms: true, moe.shared_expert_ffn_hidden_size "
        "set with moe.shared_expert_gate: true, moe.norm_topk_prob: true."]
