"""Qwen3-VL-MoE through ``loongforge convert``: the fused expert tensors (one gate_up_proj and one
down_proj per layer, every expert in each) of the folder transformers 5 saves, and the Hub's
transposed layout of them, give the same megatron checkpoint (experts stacked on (layer, expert)
axes, as megatron-core's ``SequentialMLP`` shards them); it loads into the model, which then gives
transformers' logits, and converts back to what transformers saved; ``checkpoint.load_hf`` fills
the model from them. (The TP 2 / PP 2 round trip is in test_family_roundtrips, ``--check-logits`` in
test_check_logits; training's load_hf / save_hf in tests/train/test_qwen3_vl_moe_train.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loongforge.config.schema import ParallelConfig
from loongforge.convert.engine import hf_to_mcore, mcore_to_hf
from loongforge.convert.mcore_io import MODEL_DIR, McoreReader
from tests.convert.helpers import invoke
from tests.models.test_qwen3_vl_support import (
    TINY_VISION,
    build_hf_model,
    hf_logits,
    hf_position_ids,
    make_sample,
    our_inputs,
    tiny_model_cfg,
)

TOLERANCE = 1e-5
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _save(path):
    model = build_hf_model(tiny_model_cfg(experts=True))
    model.save_pretrained(path)
    return model


def _as_hub_layout(src, dst) -> None:
    """The folder as the Hub's Qwen3-VL-MoE files store it: fused expert tensors [E, in, out]."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    transposed = [key for key in tensors if key.endswith(_FUSED)]
    assert transposed
    save_file({k: v.transpose(1, 2).contiguous() if k in transposed else v for k, v in tensors.items()},
              dst / "model.safetensors", metadata={"format": "pt"})


def _mcore_tensors(folder) -> dict[str, torch.Tensor]:
    reader = McoreReader(folder / MODEL_DIR)
    return {key: reader.read(key) for key in reader.tensors}


def test_hub_and_transformers_layouts_give_the_same_checkpoint_and_come_back_as_saved(tmp_path):
    _save(tmp_path / "hf")
    _as_hub_layout(tmp_path / "hf", tmp_path / "hub")
    hf_to_mcore(tmp_path / "hf", tmp_path / "from_hf", progress=False)
    hf_to_mcore(tmp_path / "hub", tmp_path / "from_hub", progress=False)
    ours, from_hub = _mcore_tensors(tmp_path / "from_hf"), _mcore_tensors(tmp_path / "from_hub")
    assert ours.keys() == from_hub.keys()
    assert all(torch.equal(ours[key], from_hub[key]) for key in ours)
    experts = "language_model.decoder.layers.mlp.experts.experts.linear_fc1.weight"  # SequentialMLP's name
    assert ours[experts].shape == (3, 4, 2 * 48, 64)  # [layers, experts, 2 * ffn, hidden]

    # The round trip of the Hub's layout compares in the layout written back (the same values).
    result = invoke(str(tmp_path / "hub"), "--roundtrip", "--tp", "2")
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].endswith("0 different, 0 missing, 0 unexpected: EXACT")

    report = mcore_to_hf(tmp_path / "from_hub", tmp_path / "back", progress=False, verify=True)
    assert report.verify_mismatches == []
    saved, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[key], saved[key]) for key in saved)


@pytest.mark.parametrize("experts", [True, False], ids=["moe", "dense"])
def test_converted_checkpoint_loads_into_the_model_and_back(megatron_world_of_one, tmp_path, experts):
    """The export is in Qwen3-VL's own key style (``model.visual.*``, ``model.language_model.*``):
    transformers 5 loads every tensor of it, dense or MoE."""
    from transformers import AutoModelForImageTextToText

    from loongforge.models.qwen3_vl.model import build_model
    from loongforge.train.checkpoint import load_checkpoint

    model_cfg = tiny_model_cfg(experts=experts)
    hf_model = build_hf_model(model_cfg)
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu", vision=TINY_VISION).eval()
    load_checkpoint(tmp_path / "mcore", [model], optimizer=None, scheduler=None)
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    with torch.no_grad():
        logits = model(**our_inputs(sample, hf_position_ids(hf_model, sample)))
    assert (logits - hf_logits(hf_model, sample)).abs().max() <= TOLERANCE

    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert type(reloaded) is type(hf_model)
    reloaded = reloaded.state_dict()
    for key, tensor in hf_model.state_dict().items():
        assert torch.equal(reloaded[key], tensor), key


@pytest.mark.parametrize("shape_change", ["experts", "width"])
def test_a_fused_tensor_of_another_model_is_refused_naming_it(tmp_path, shape_change):
    _save(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    key = "model.language_model.layers.1.mlp.experts.down_proj"
    tensors[key] = (tensors[key][:3] if shape_change == "experts" else tensors[key][..., :40]).contiguous()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    result = invoke(str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "mcore")
    assert result.exit_code != 0
    assert f"tensor {key} has shape" in result.output


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_load_hf_fills_each_expert_from_the_fused_tensors(megatron_world_of_one, tmp_path, layout):
    """``checkpoint.load_hf=DIR`` (``model_io.load_hf_weights``): the weights the in-memory map loads,
    from either layout of the expert tensors on disk."""
    from loongforge.convert.model_io import load_hf_weights
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.qwen3_vl.model import build_model

    hf_model = _save(tmp_path / "transformers")
    if layout == "hub":
        _as_hub_layout(tmp_path / "transformers", tmp_path / "hub")
    model_cfg = tiny_model_cfg(experts=True)
    from_disk, from_memory = (build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                                          post_process=True, device="cpu", vision=TINY_VISION) for _ in range(2))
    loaded = load_hf_weights(from_disk, tmp_path / layout)
    load_hf_state_dict(from_memory, hf_model.state_dict())
    expected = {k: v for k, v in from_memory.state_dict().items() if not k.endswith("_extra_state")}
    assert loaded == len(expected)
    assert all(torch.equal(from_disk.state_dict()[k], v) for k, v in expected.items())
