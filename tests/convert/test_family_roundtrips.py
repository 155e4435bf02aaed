"""Every model family converts HF -> megatron (TP 2, PP 2) -> HF bit-exact: the text-only LLMs
(Qwen2, Qwen3, Llama), Qwen3-VL (vision blocks, the merger and DeepStack's mergers), dense and
MoE (Qwen3-VL-MoE: one gate_up_proj and one down_proj per layer holding every expert), InternVL3.5
(InternViT's class token, positions and layer scales, the pixel-shuffle projector, Qwen3 under
``model.language_model.``) and LLaVA-OneVision (SigLIP with its carried post-layernorm, the projector, the
newline, Qwen2) and Qwen3.5 (hybrid: each layer's own checkpoint keys, Gated DeltaNet's key-head-grouped
projection and convolution, the gated attention's query and gate rows) and DeepSeek-V3 / V2 (multi-latent
attention, the dense first layer and the sparse ones under keys of their own, the expert bias; V3 with its
multi-token-prediction layer as DeepSeek publishes it)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.convert.helpers import invoke
from tests.models.llm_helpers import ARCHITECTURES, DEEPSEEK_ARCHITECTURES, build_hf_llm


def _save_qwen3_vl(path, experts: bool = False) -> int:
    from tests.models.test_qwen3_vl_support import build_hf_model, tiny_model_cfg

    model_cfg = tiny_model_cfg(experts=experts)
    # 4 decoder layers: PP 2 leaves both DeepStack layers on the first stage.
    model_cfg = dataclasses.replace(model_cfg, language=dataclasses.replace(model_cfg.language, num_layers=4))
    model = build_hf_model(model_cfg)
    model.save_pretrained(path)
    return len(model.state_dict()) - int(model_cfg.language.tie_word_embeddings)


def _save_composition(family: str, path, preset: str = "") -> int:
    """transformers' model of ``family`` at its tiny preset's (or ``preset``'s) shapes (small vocabulary, 4
    decoder layers), every parameter random."""
    import torch
    import transformers

    from loongforge.config.loader import load_run_config
    from loongforge.models.registry import get_family
    from tests.models.tower_helpers import randomised

    preset = f"{preset or get_family(family).tiny_preset}-small-vocab"
    cfg = load_run_config(preset, overrides=["model.language.num_layers=4"])
    config = transformers.AutoConfig.for_model(**get_family(family).config_to_hf(cfg.model, "float32"))
    torch.manual_seed(0)
    model = randomised(transformers.AutoModelForImageTextToText.from_config(config))
    model.save_pretrained(path)
    # transformers 5 saves routed experts as the Hub does (one tensor per expert): count what it wrote.
    written = get_family(family).to_hub_style(model.state_dict())
    return len(written) - int(cfg.model.language.tie_word_embeddings)


def _save_llm(arch: str, path) -> int:
    model = build_hf_llm(arch)
    model.save_pretrained(path)
    return len(model.state_dict()) - int(model.config.tie_word_embeddings)


def _save_deepseek(arch: str, path) -> int:
    """DeepSeek at 4 layers (PP 2: the dense first layer and a sparse one on each stage), expert bias random."""
    from loongforge.models.registry import get_family

    model = build_hf_llm(arch, num_hidden_layers=4)
    model.save_pretrained(path)
    return len(get_family("llm").to_hub_style(model.state_dict()))


def _save_deepseek_with_mtp(path) -> int:
    """DeepSeek-V3 as its Hub checkpoint stores it: 4 decoder layers, then the multi-token-prediction layer
    (``num_nextn_predict_layers: 1``) as layer 4 with its norms, projection and copies of the embedding and head."""
    import json

    import torch
    from safetensors.torch import save_file

    from loongforge.models.registry import get_family

    model = build_hf_llm("deepseek_v3", num_hidden_layers=5)  # layer 4: the MTP layer's decoder layer
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=4, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    state, h = model.state_dict(), model.config.hidden_size
    generator = torch.Generator().manual_seed(5)
    extra = {"model.layers.4.enorm.weight": 1 + 0.1 * torch.randn(h, generator=generator),
             "model.layers.4.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=generator),
             "model.layers.4.eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=generator),
             "model.layers.4.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=generator),
             "model.layers.4.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
             "model.layers.4.shared_head.head.weight": state["lm_head.weight"].clone()}
    save_file(extra, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    return len(get_family("llm").to_hub_style(state)) + len(extra)


@pytest.mark.parametrize("family", [*ARCHITECTURES, *DEEPSEEK_ARCHITECTURES, "deepseek_v3_mtp", "qwen3_vl", "qwen3_vl_moe", "internvl",
                                    "llava_onevision", "qwen3_5", "qwen3_5_moe"])
def test_hf_to_tp2_pp2_to_hf_is_exact(family, tmp_path):
    src = tmp_path / "hf"
    if family.startswith("qwen3_vl"):
        tensors = _save_qwen3_vl(src, experts=family == "qwen3_vl_moe")
    elif family in ("internvl", "llava_onevision", "qwen3_5"):
        tensors = _save_composition(family, src)
    elif family == "qwen3_5_moe":
        tensors = _save_composition("qwen3_5", src, preset="qwen3.5-moe-tiny")
    elif family in DEEPSEEK_ARCHITECTURES:
        tensors = _save_deepseek(family, src)
    elif family == "deepseek_v3_mtp":
        tensors = _save_deepseek_with_mtp(src)
    else:
        tensors = _save_llm(family, src)
    result = invoke(str(src), "--roundtrip", "--tp", "2", "--pp", "2")
    assert result.exit_code == 0, result.output
    verdict = result.output.strip().splitlines()[-1]
    print(f"{family}: {verdict}")
    assert verdict.startswith("round trip HF -> mcore (tp=2, pp=2")
    assert verdict.endswith(f"{tensors} exact, 0 close, 0 different, 0 missing, 0 unexpected: EXACT"), verdict


def test_qwen3_5s_multi_token_prediction_head_is_noted_not_read(tmp_path):
    """The Hub's Qwen3.5 checkpoints carry an MTP head (``mtp.*``) the model has no place for (transformers skips
    it too): conversion notes it and reads the rest; a stray tensor elsewhere is still one line, exit 2."""
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    tensors = _save_composition("qwen3_5", src)
    save_file({"mtp.fc.weight": torch.zeros(4, 4), "mtp.norm.weight": torch.zeros(4)}, str(src / "mtp.safetensors"))
    _drop_index(src)
    result = invoke(str(src), str(tmp_path / "mcore"), "--to", "mcore")
    assert result.exit_code == 0, result.output
    assert "2 tensors under mtp. not read" in result.output
    result = invoke(str(src), "--roundtrip", "--tp", "2", "--pp", "2")
    assert result.exit_code == 0 and "2 tensors of the source not read" in result.output, result.output
    assert result.output.strip().endswith(f"{tensors} exact, 0 close, 0 different, 0 missing, 0 unexpected: EXACT")
    save_file({"model.stray.weight": torch.zeros(2)}, str(src / "stray.safetensors"))
    result = invoke(str(src), str(tmp_path / "mcore2"), "--to", "mcore")
    assert result.exit_code == 2 and "unexpected tensor model.stray.weight" in result.output, result.output


def _drop_index(folder) -> None:
    """Without the index the files' headers say what each holds (the added files included)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
