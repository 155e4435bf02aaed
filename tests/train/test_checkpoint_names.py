"""Checkpoint names: every backend writes TE's fused norm names; separate-norm checkpoints (megatron's
local spec, loongforge before the fused layout) and checkpoints without ``_extra_state`` still load."""

from __future__ import annotations

import json

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject

from loongforge.config.schema import ParallelConfig
from loongforge.models.qwen2_5_vl.model import build_model
from loongforge.models.hf.state_dict_names import separate_name
from loongforge.train.checkpoint import fit_to_checkpoint_names, load_checkpoint
from tests.models.helpers import destroy_megatron, free_port, init_megatron, tiny_model_cfg


@pytest.fixture
def world_of_one():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


def _model(seed: int):
    torch.manual_seed(seed)
    return build_model(tiny_model_cfg(), ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                       post_process=True, device="cpu")


def test_norms_live_in_the_following_linear_as_in_transformer_engine(world_of_one):
    keys = set(_model(0).state_dict())
    for tower, count in (("vision_model.layers", 2), ("language_model.decoder.layers", 2)):
        for i in range(count):
            assert f"{tower}.{i}.self_attention.linear_qkv.layer_norm_weight" in keys
            assert f"{tower}.{i}.mlp.linear_fc1.layer_norm_weight" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)


def test_fit_renames_to_separate_names_and_drops_objects_the_checkpoint_lacks(world_of_one):
    sharded = _model(0).sharded_state_dict()
    tensors = {name: item for name, item in sharded.items() if not isinstance(item, ShardedObject)}
    saved = {separate_name(item.key) for item in tensors.values()}
    fitted = fit_to_checkpoint_names(sharded, saved)
    assert set(fitted) == set(tensors)  # every tensor kept, every _extra_state object dropped
    renamed = fitted["language_model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    assert renamed.key == "language_model.decoder.layers.input_layernorm.weight"
    assert all(item.key in saved for item in fitted.values())


def test_a_separate_norm_checkpoint_loads_into_the_fused_model(world_of_one, tmp_path):
    """Written the old way (norm modules of their own), read by today's model: identical weights."""
    source = _model(1)
    sharded = {name: item for name, item in source.sharded_state_dict().items()
               if not isinstance(item, ShardedObject)}
    for item in sharded.values():
        item.key = separate_name(item.key)
    (tmp_path / "model_optim").mkdir()
    dist_checkpointing.save(sharded, str(tmp_path / "model_optim"))
    (tmp_path / "meta.json").write_text(json.dumps({"step": 0, "kind": "model"}))
    target = _model(2)
    load_checkpoint(tmp_path, [target], optimizer=None, scheduler=None)
    expected = source.state_dict()
    for key, value in target.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, expected[key]), key
