"""Qwen (1.0)'s published key layout (``models/llm/qwen1.py``) into the Qwen2-style decoder: a tiny random
transformers Qwen2 (no GQA, as every Qwen (1.0) size) renamed to Qwen (1.0)'s keys and config.json (q/k/v fused into
``c_attn``, ``w2`` the gate and ``w1`` the up projection, as Qwen's MLP ``c_proj(w1(x) * silu(w2(x)))`` defines
them) gives transformers' logits, and converts HF -> megatron (TP 2, PP 2) -> HF bit-exact in its own layout."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.llm.model import build_model
from loongforge.models.registry import get_family
from tests.convert.helpers import invoke
from tests.convert.test_family_roundtrips import _tensors_in
from tests.models.llm_helpers import build_hf_llm, text_positions

HEADS, LAYERS = 4, 2
# Qwen-7B's config.json fields at toy size (its intermediate_size holds w1's and w2's rows: twice the MLP width).
QWEN1_CONFIG = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "hidden_size": 64,
                "intermediate_size": 192, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "kv_channels": 16,
                "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0, "vocab_size": 300,
                "seq_length": 8192, "max_position_embeddings": 8192, "no_bias": True, "tie_word_embeddings": False,
                "use_dynamic_ntk": True, "use_logn_attn": True, "eos_token_id": 151643}


def _qwen2():
    return build_hf_llm("qwen2", num_key_value_heads=HEADS, num_hidden_layers=LAYERS)


def qwen1_state(qwen2_state: dict, layers: int = LAYERS) -> dict:
    """Qwen2's tensors under Qwen (1.0)'s names (the mapping ``qwen1``'s docstring states)."""
    state = {"transformer.wte.weight": qwen2_state["model.embed_tokens.weight"],
             "transformer.ln_f.weight": qwen2_state["model.norm.weight"], "lm_head.weight": qwen2_state["lm_head.weight"]}
    for i in range(layers):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            state[ours + f"attn.c_attn.{kind}"] = torch.cat([qwen2_state[theirs + f"self_attn.{p}_proj.{kind}"]
                                                             for p in "qkv"])
        state.update({ours + "ln_1.weight": qwen2_state[theirs + "input_layernorm.weight"],
                      ours + "attn.c_proj.weight": qwen2_state[theirs + "self_attn.o_proj.weight"],
                      ours + "ln_2.weight": qwen2_state[theirs + "post_attention_layernorm.weight"],
                      ours + "mlp.w1.weight": qwen2_state[theirs + "mlp.up_proj.weight"],
                      ours + "mlp.w2.weight": qwen2_state[theirs + "mlp.gate_proj.weight"],
                      ours + "mlp.c_proj.weight": qwen2_state[theirs + "mlp.down_proj.weight"]})
    return {key: value.contiguous() for key, value in state.items()}


def test_qwen1_mlp_is_qwen2s_with_w2_the_gate():
    hf_model = _qwen2()
    state = qwen1_state(hf_model.state_dict())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    w1, w2, c_proj = (state[f"transformer.h.0.mlp.{name}.weight"] for name in ("w1", "w2", "c_proj"))
    with torch.no_grad():
        qwen1 = F.linear(F.linear(x, w1) * F.silu(F.linear(x, w2)), c_proj)  # Qwen's QWenMLP.forward
        assert torch.allclose(qwen1, hf_model.model.layers[0].mlp(x), atol=1e-6)


def test_qwen1_checkpoint_gives_transformers_qwen2_logits(megatron_world_of_one):
    hf_model = _qwen2()
    model_cfg = get_family("llm").config_from_hf(QWEN1_CONFIG, "qwen/config.json")
    lang = model_cfg.language
    assert (lang.ffn_hidden_size, lang.num_query_groups, lang.add_qkv_bias, lang.rope_theta) == (96, HEADS, True, 1e4)
    assert get_family("llm").config_problems(model_cfg) == []
    assert get_family("llm").hf_shapes(model_cfg) == {k: tuple(v.shape) for k, v in qwen1_state(hf_model.state_dict()).items()}
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True,
                        device="cpu").eval()
    load_hf_state_dict(model, qwen1_state(hf_model.state_dict()))
    input_ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(input_ids=input_ids, position_ids=text_positions(24))[..., :300]
        theirs = hf_model(input_ids=input_ids).logits
    diff = float((ours - theirs).abs().max())
    print(f"\nQwen (1.0) layout vs transformers' Qwen2: logits differ by {diff:.1e}")
    assert diff <= 1e-5


def test_qwen1_folder_round_trips_through_tp2_pp2(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    state = qwen1_state(build_hf_llm("qwen2", num_key_value_heads=HEADS, num_hidden_layers=4).state_dict(), 4)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({**QWEN1_CONFIG, "num_hidden_layers": 4}))
    result = invoke(str(src), "--roundtrip", "--tp", "2", "--pp", "2")
    verdict = result.output.strip().splitlines()[-1]
    print(f"\nQwen (1.0): {verdict}")
    assert result.exit_code == 0 and verdict.endswith(f"{len(state)} exact, 0 close, 0 different, 0 missing, "
                                                      "0 unexpected: EXACT"), result.output
    for args in ((str(src), str(tmp_path / "mcore"), "--to", "mcore", "--tp", "2", "--pp", "2"),
                 (str(tmp_path / "mcore"), str(tmp_path / "back"), "--to", "hf")):
        assert invoke(*args).exit_code == 0
    before, after = _tensors_in(src), _tensors_in(tmp_path / "back")
    assert {k: v[1:] for k, v in before.items()} == {k: v[1:] for k, v in after.items()}
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["QWenLMHeadModel"] and written["intermediate_size"] == 192
