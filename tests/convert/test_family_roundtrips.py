"""The HF round trip concern: every reference of ``tests.models.references.REFERENCES`` (the text architectures, the
Qwen-VL families dense and MoE, Qwen3.5 dense and MoE, InternVL3.5, LLaVA-OneVision, DeepSeek-V3 / V2) converts HF ->
megatron (TP 2, PP 2) -> HF bit-exact; a reference that proves no more than another names it in ``PROVEN_BY``. What
the references bring: Qwen3-VL's vision blocks, merger and DeepStack's mergers, Qwen3-VL-MoE's one gate_up_proj and
one down_proj per layer holding every expert, InternVL3.5's class token, positions and layer scales, the pixel-shuffle
projector and Qwen3 under ``model.language_model.``, LLaVA-OneVision's SigLIP with its carried post-layernorm, the
projector, the newline and Qwen2 (in shards with an index, as the Hub's are), Qwen3.5's hybrid layers (each layer's
own checkpoint keys, Gated DeltaNet's key-head-grouped projection and convolution, the gated attention's query and
gate rows), DeepSeek's multi-latent attention, the dense first layer and the sparse ones under keys of their own and
the expert bias; DeepSeek-V3 also with its multi-token-prediction layer as DeepSeek publishes it
(``test_deepseek_v3s_multi_token_prediction_layer_round_trips``).

Each folder (``Reference.save_hf`` at the small test vocabulary), converted to megatron
(TP 2, PP 2) by ``convert --to mcore`` and back by ``convert --to hf``, is the folder transformers' ``save_pretrained``
wrote: the same tensor names (the Hub's, which ``save_pretrained`` writes back from its module names), dtypes, shapes
and bytes, in the same files, and the same config.json and generation_config.json; the export may add files (an
index, the serving files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongforge.convert.hf_io import HFCheckpoint, read_header
from tests.convert.helpers import invoke
from tests.models.llm_helpers import build_hf_llm
from tests.models.references import REFERENCES, assert_proven_once, runs


def _save_deepseek_with_mtp(path) -> int:
    """DeepSeek-V3 as its Hub checkpoint stores it: 4 decoder layers, then the multi-token-prediction layer
    (``num_nextn_predict_layers: 1``) as layer 4 with its norms, projection and copies of the embedding and head."""
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


def _save_for_pp2(name: str, path: Path) -> int:
    """The reference's folder as the round trip converts it (its layers for PP 2, the small test vocabulary: the round
    trip tokenizes nothing), and the tensors written."""
    reference = REFERENCES[name]
    return reference.save_hf(path, num_layers=reference.pp2_layers, small_vocabulary=True, **reference.roundtrip_save)


def test_every_reference_round_trips_or_names_its_prover():
    assert_proven_once("hf_roundtrip", globals())


@pytest.mark.parametrize("family", runs("hf_roundtrip"))
def test_hf_to_tp2_pp2_to_hf_is_exact(family, tmp_path):
    _assert_round_trip_exact(family, _save_for_pp2(family, tmp_path / "hf"), tmp_path)


def test_deepseek_v3s_multi_token_prediction_layer_round_trips(tmp_path):
    _assert_round_trip_exact("deepseek_v3_mtp", _save_deepseek_with_mtp(tmp_path / "hf"), tmp_path)


def _assert_round_trip_exact(what: str, tensors: int, tmp_path: Path) -> None:
    """``convert --roundtrip --tp 2 --pp 2`` of ``tmp_path / "hf"`` (holding ``tensors``) is exact, and the folder
    converted to megatron and back is the folder read."""
    src = tmp_path / "hf"
    result = invoke(str(src), "--roundtrip", "--tp", "2", "--pp", "2")
    assert result.exit_code == 0, result.output
    verdict = result.output.strip().splitlines()[-1]
    print(f"{what}: {verdict}")
    assert verdict.startswith("round trip HF -> mcore (tp=2, pp=2")
    assert verdict.endswith(f"{tensors} exact, 0 close, 0 different, 0 missing, 0 unexpected: EXACT"), verdict
    for args in ((str(src), str(tmp_path / "mcore"), "--to", "mcore", "--tp", "2", "--pp", "2"),
                 (str(tmp_path / "mcore"), str(tmp_path / "back"), "--to", "hf")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    differences = _folder_differences(src, tmp_path / "back")
    added = sorted({p.name for p in (tmp_path / "back").iterdir()} - {p.name for p in src.iterdir()})
    print(f"{what}: HF -> mcore -> HF ({len(list(src.glob('*.safetensors')))} safetensors files) differs from the "
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
    tensors = _save_for_pp2("qwen3_5", src)
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
    tensors = _save_for_pp2(family, hub)
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
