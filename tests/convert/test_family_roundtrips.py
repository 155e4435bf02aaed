"""Every model family converts HF -> megatron (TP 2, PP 2) -> HF bit-exact: the text-only LLMs
(Qwen2, Qwen3, Llama), Qwen3-VL (vision blocks, the merger and DeepStack's mergers), dense and
MoE (Qwen3-VL-MoE: one gate_up_proj and one down_proj per layer holding every expert), InternVL3.5
(InternViT's class token, positions and layer scales, the pixel-shuffle projector, Qwen3 under
``model.language_model.``) and LLaVA-OneVision (SigLIP with its carried post-layernorm, the projector, the
newline, Qwen2) and Qwen3.5 (hybrid: each layer's own checkpoint keys, Gated DeltaNet's key-head-grouped
projection and convolution, the gated attention's query and gate rows) and DeepSeek-V3 / V2 (multi-latent
attention, the dense first layer and the sparse ones under keys of their own, the expert bias; V3 with its
multi-token-prediction layer as DeepSeek publishes it), Qwen3-MoE and Qwen2.5-VL.

Each family's folder, converted to megatron (TP 2, PP 2) by ``convert --to mcore`` and back by ``convert --to hf``,
is the folder transformers' ``save_pretrained`` wrote: the same tensor names (the Hub's, which
``save_pretrained`` writes back from its module names), dtypes, shapes and bytes, in the same files, and the same
config.json and generation_config.json; the export may add files (an index, the serving files)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loongforge.convert.hf_io import HFCheckpoint, read_header
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


def _save_composition(family: str, path, preset: str = "", **save_options) -> int:
    """transformers' model of ``family`` at its tiny preset's (or ``preset``'s) shapes (small vocabulary, 4
    decoder layers), every parameter random, saved with ``save_options``."""
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
    model.save_pretrained(path, **save_options)
    # transformers 5 saves routed experts as the Hub does (one tensor per expert): count what it wrote.
    written = get_family(family).to_hub_style(model.state_dict())
    return len(written) - int(cfg.model.language.tie_word_embeddings)


def _save_llm(arch: str, path) -> int:
    from loongforge.models.registry import get_family

    model = build_hf_llm(arch)
    model.save_pretrained(path)
    # transformers 5 saves Qwen3-MoE's routed experts as the Hub does (one tensor per expert): count what it wrote.
    return len(get_family("llm").to_hub_style(model.state_dict())) - int(model.config.tie_word_embeddings)


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


@pytest.mark.parametrize("family", [*ARCHITECTURES, "qwen3_moe", *DEEPSEEK_ARCHITECTURES, "deepseek_v3_mtp",
                                    "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl", "llava_onevision",
                                    "qwen3_5", "qwen3_5_moe"])
def test_hf_to_tp2_pp2_to_hf_is_exact(family, tmp_path):
    src = tmp_path / "hf"
    if family.startswith("qwen3_vl"):
        tensors = _save_qwen3_vl(src, experts=family == "qwen3_vl_moe")
    elif family == "llava_onevision":  # in shards with an index, as the Hub's are
        tensors = _save_composition(family, src, max_shard_size="1MB")
    elif family in ("qwen2_5_vl", "internvl", "qwen3_5"):
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
    for args in ((str(src), str(tmp_path / "mcore"), "--to", "mcore", "--tp", "2", "--pp", "2"),
                 (str(tmp_path / "mcore"), str(tmp_path / "back"), "--to", "hf")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    differences = _folder_differences(src, tmp_path / "back")
    added = sorted({p.name for p in (tmp_path / "back").iterdir()} - {p.name for p in src.iterdir()})
    print(f"{family}: HF -> mcore -> HF ({len(list(src.glob('*.safetensors')))} safetensors files) differs from the "
          f"folder read in {differences or 'nothing'}; added {added}")
    assert differences == []
    assert not [name for name in added if "safetensors" in name]  # the serving files only


def _tensors_in(folder: Path) -> dict[str, tuple[str, str, list[int], bytes]]:
    """Tensor name -> (file, safetensors dtype, shape, raw bytes) of every tensor of the folder's files."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        header, data_start = read_header(file)
        data = file.read_bytes()[data_start:]
        for key, info in header.items():
            if key != "__metadata__":
                start, end = info["data_offsets"]
                tensors[key] = (file.name, info["dtype"], info["shape"], data[start:end])
    return tensors


def _json_differences(name: str, read: dict, written: dict, where: str = "") -> list[str]:
    """``name: field read -> written`` for every field that differs (an object's fields each; an index's
    weight map as a count and its first entry)."""
    lines = []
    for key in sorted(set(read) | set(written)):
        left, right = read.get(key, "(absent)"), written.get(key, "(absent)")
        if left == right:
            continue
        if isinstance(left, dict) and isinstance(right, dict):
            inner = _json_differences(name, left, right, f"{where}{key}.")
            lines += inner if key != "weight_map" else [f"{inner[0]} and {len(inner) - 1} more"]
        else:
            lines.append(f"{name}: {where}{key} {left} -> {right}")
    return lines


def _folder_differences(read: Path, written: Path) -> list[str]:
    """What of the HF folder ``read`` the folder ``written`` does not give back: its safetensors files, its
    tensors (name, dtype, shape, bytes, file), its index's weight map, every other file of it (JSON files
    compared as JSON). One line per kind of difference, naming the first tensor or field."""
    lines = []
    missing = sorted(p.name for p in read.iterdir() if not (written / p.name).exists())
    if missing:
        lines.append(f"files: {', '.join(missing)} missing")
    before, after = _tensors_in(read), _tensors_in(written)
    for what, keys in (("missing", sorted(set(before) - set(after))), ("unexpected", sorted(set(after) - set(before))),
                       ("different", sorted(k for k in set(before) & set(after) if before[k][1:] != after[k][1:]))):
        if keys:
            lines.append(f"tensors: {len(keys)} {what} ({keys[0]})")
    moved = sorted(k for k in set(before) & set(after) if before[k][0] != after[k][0])
    if moved:
        lines.append(f"tensors: {len(moved)} in another file ({moved[0]}: {before[moved[0]][0]} -> {after[moved[0]][0]})")
    for file in sorted(read.iterdir()):
        if file.suffix == ".safetensors" or not (written / file.name).exists():
            continue
        if file.suffix == ".json":
            lines += _json_differences(file.name, json.loads(file.read_text()),
                                       json.loads((written / file.name).read_text()))
        elif file.read_bytes() != (written / file.name).read_bytes():
            lines.append(f"{file.name}: different bytes")
    return lines


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


@pytest.mark.parametrize("family", ["internvl", "llava_onevision"])
def test_transformers_module_names_are_read_as_the_hubs(family, tmp_path):
    """A folder under transformers' module names (its state dict: ``model.language_model.*``, ``lm_head.*``, as
    folders in the wild hold them) reads as the folder ``save_pretrained`` writes under the Hub's names, which a
    conversion then writes (``test_hf_to_tp2_pp2_to_hf_is_exact``)."""
    import transformers
    from safetensors.torch import save_file

    hub, modules = tmp_path / "hub", tmp_path / "modules"
    tensors = _save_composition(family, hub)
    state = transformers.AutoModelForImageTextToText.from_pretrained(hub).state_dict()
    if json.loads((hub / "config.json").read_text())["text_config"].get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    modules.mkdir()
    save_file({key: tensor.contiguous() for key, tensor in state.items()}, str(modules / "model.safetensors"))
    (modules / "config.json").write_text((hub / "config.json").read_text())
    read, saved = HFCheckpoint(modules).entries, _tensors_in(hub)
    print(f"{family}: {sum(key.startswith('model.language_model.') for key in state)} of {len(state)} tensors under "
          f"module names read; {len(read.keys() ^ saved.keys())} names unlike save_pretrained's")
    assert read.keys() == saved.keys() and any(key.startswith("model.language_model.") for key in state)
    result = invoke(str(modules), "--roundtrip", "--tp", "2", "--pp", "2")
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(f"{tensors} exact, 0 close, 0 different, 0 missing, 0 unexpected: EXACT")
