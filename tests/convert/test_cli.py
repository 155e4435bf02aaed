"""``loongforge convert`` end to end on tiny checkpoints: both directions, round trip, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.console import assert_no_third_party_warning, console_of
from tests.convert.helpers import hub_state, invoke, one_line_error, save_hf_checkpoint
from tests.models.helpers import tiny_model_cfg


@pytest.fixture(scope="module")
def hf_hub(tmp_path_factory) -> Path:
    """Untied, Hub key style, two shards + index, flat config."""
    folder = tmp_path_factory.mktemp("hf") / "hub"
    save_hf_checkpoint(folder, tiny_model_cfg(tie=False), style="hub")
    return folder


@pytest.fixture(scope="module")
def hf_new(tmp_path_factory) -> Path:
    """Tied, transformers-5 key style, one file, nested config."""
    folder = tmp_path_factory.mktemp("hf") / "new"
    save_hf_checkpoint(folder, tiny_model_cfg(tie=True), style="new")
    return folder


@pytest.mark.parametrize("source", ["hf_hub", "hf_new"])
def test_hf_to_mcore_to_hf_is_bit_exact(request, tmp_path, source):
    src = request.getfixturevalue(source)
    result = invoke(str(src), str(tmp_path / "mcore"), "--to", "mcore", "--tp", "2", "--pp", "2", "--verify")
    assert result.exit_code == 0, result.output
    assert "verify: all tensors equal" in result.output
    meta = json.loads((tmp_path / "mcore" / "meta.json").read_text())
    assert meta["kind"] == "model" and meta["step"] == 0
    result = invoke(str(tmp_path / "mcore"), str(tmp_path / "back"), "--to", "hf", "--verify",
                    "--max-shard-size", "50MB")
    assert result.exit_code == 0, result.output
    original, back = hub_state(src), hub_state(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(back) and len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in back.values())
    # config and side files come through unchanged; no temporary folder is left behind
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    side = [f.name for f in src.iterdir() if f.name in ("tokenizer_config.json", "generation_config.json")]
    assert side and all((tmp_path / "back" / name).is_file() for name in side)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "mcore"]


def test_dtype_cast(hf_hub, tmp_path):
    result = invoke(str(hf_hub), str(tmp_path / "m"), "--to", "mcore", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    invoke(str(tmp_path / "m"), str(tmp_path / "h"), "--to", "hf")
    back = hub_state(tmp_path / "h")
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    assert torch.equal(back["model.norm.weight"], hub_state(hf_hub)["model.norm.weight"].bfloat16())


@pytest.mark.parametrize("source", ["hf_hub", "hf_new"])
def test_roundtrip_table_and_json(request, source, capfd):
    src = request.getfixturevalue(source)
    result, stderr = console_of(capfd, lambda: invoke(str(src), "--roundtrip", "--tp", "2", "--pp", "2", "--vision-tp", "1"))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, f"convert --roundtrip --tp 2 --pp 2 ({source})")
    assert "EXACT" in result.output.splitlines()[-1] and "0 different" in result.output
    result = invoke(str(src), "--roundtrip", "--tp", "2", "--json")
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["exact"] and report["counts"]["different"] == 0 and not report["missing"]


def test_roundtrip_not_exact_exits_1(hf_hub, monkeypatch):
    from loongforge.models.hf.rules import GateUp

    # A broken transform (gate and up swapped on the way back) must be caught.
    monkeypatch.setattr(GateUp, "unshard", lambda self, shards: list(reversed(
        [torch.cat(x) for x in zip(*(s.chunk(2, dim=0) for s in shards))])))
    result = invoke(str(hf_hub), "--roundtrip", "--json")
    assert result.exit_code == 1
    report = json.loads(result.output.strip().splitlines()[-1])
    assert not report["exact"] and report["counts"]["different"] > 0


def test_roundtrip_catches_swapped_tp_shards(hf_hub, monkeypatch, tmp_path):
    from loongforge.convert import roundtrip as roundtrip_module
    from loongforge.models.hf.rules import Split

    correct = roundtrip_module.rank_regions

    def swapped(transform, local, rank, size):
        # A sharded writer that puts TP rank 0's row-parallel shard where rank 1's belongs and back.
        if isinstance(transform, Split) and transform.dim == 1:
            rank = size - 1 - rank
        return correct(transform, local, rank, size)

    monkeypatch.setattr(roundtrip_module, "rank_regions", swapped)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    result = invoke(str(hf_hub), "--roundtrip", "--tp", "2", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    different = {t["key"] for t in report["tensors"] if t["status"] == "different"}
    # Exactly the row-parallel weights: attention output and MLP down projections, merger fc2.
    assert different and all(k.endswith(("o_proj.weight", "attn.proj.weight", "down_proj.weight",
                                          "merger.mlp.2.weight")) for k in different), different
    assert "model.layers.1.self_attn.o_proj.weight" in different
    assert list(tmp_path.iterdir()) == []  # the temporary checkpoint is gone
    # At TP 1 there is nothing to swap: the same writer is exact.
    assert invoke(str(hf_hub), "--roundtrip", "--json").exit_code == 0


def test_refuses_to_overwrite(hf_hub, tmp_path):
    (tmp_path / "dst").mkdir()
    result = invoke(str(hf_hub), str(tmp_path / "dst"), "--to", "mcore")
    assert result.exit_code == 2 and "--overwrite" in one_line_error(result)
    assert invoke(str(hf_hub), str(tmp_path / "dst"), "--to", "mcore", "--overwrite").exit_code == 0
    assert (tmp_path / "dst" / "meta.json").is_file()


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def _assert_bad_input(result, tmp_path: Path, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    line = one_line_error(result)
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "dst").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dst")]  # no temporary left


def test_truncated_safetensors(hf_hub, tmp_path):
    src = _copy(hf_hub, tmp_path)
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    result = invoke(str(src), str(tmp_path / "dst"), "--to", "mcore")
    _assert_bad_input(result, tmp_path, str(shard), "truncated", "tensor ")


def test_missing_shard(hf_hub, tmp_path):
    src = _copy(hf_hub, tmp_path)
    (src / "model-00001-of-00002.safetensors").unlink()
    result = invoke(str(src), str(tmp_path / "dst"), "--to", "mcore")
    _assert_bad_input(result, tmp_path, "model-00001-of-00002.safetensors", "missing", "holds ")


def test_shape_mismatch_against_preset(hf_hub, tmp_path):
    result = invoke(str(hf_hub), str(tmp_path / "dst"), "--to", "mcore", "--preset", "qwen2.5vl-7b")
    _assert_bad_input(result, tmp_path, "model-0000", "tensor ", "preset qwen2.5vl-7b expects")


def test_wrong_architecture(hf_hub, tmp_path):
    src = _copy(hf_hub, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["GemmaForCausalLM"], model_type="gemma")
    (src / "config.json").write_text(json.dumps(config))
    result = invoke(str(src), str(tmp_path / "dst"), "--to", "mcore")
    _assert_bad_input(result, tmp_path, str(src / "config.json"), "GemmaForCausalLM")


def test_tensor_of_wrong_shape_in_checkpoint(hf_hub, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _copy(hf_hub, tmp_path)
    shard = src / "model-00002-of-00002.safetensors"
    state = load_file(str(shard))
    key = next(k for k in state if k.endswith("up_proj.weight"))
    state[key] = state[key][:-1].clone()
    save_file(state, str(shard))
    result = invoke(str(src), str(tmp_path / "dst"), "--to", "mcore")
    _assert_bad_input(result, tmp_path, str(shard), key)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    result = invoke(str(tmp_path / "empty"), str(tmp_path / "dst"), "--to", "hf")
    _assert_bad_input(result, tmp_path, "empty")


def test_reads_separate_norm_names(hf_hub, tmp_path):
    """convert writes the fused norm names (TE's, ``linear_qkv.layer_norm_weight``); a checkpoint
    with separate norm modules (megatron's local spec, loongforge before 0.2) converts the same."""
    from loongforge.convert.mcore_io import McoreItem, McoreReader, write_mcore
    from loongforge.models.hf.state_dict_names import separate_name

    assert invoke(str(hf_hub), str(tmp_path / "plain"), "--to", "mcore").exit_code == 0
    reader = McoreReader(tmp_path / "plain" / "model_optim")
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in reader.tensors)
    assert not any("input_layernorm" in k for k in reader.tensors)
    items = [McoreItem(separate_name(key), reader.shape(key), reader.dtype(key), None,
                       lambda key=key: reader.read(key)) for key in reader.tensors]
    te = tmp_path / "te"
    write_mcore(te / "model_optim", items)
    assert any("input_layernorm" in k for k in McoreReader(te / "model_optim").tensors)
    shutil.copytree(tmp_path / "plain" / "hf", te / "hf")
    shutil.copy(tmp_path / "plain" / "meta.json", te / "meta.json")
    result = invoke(str(te), str(tmp_path / "back"), "--to", "hf")
    assert result.exit_code == 0, result.output
    original, back = hub_state(hf_hub), hub_state(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
