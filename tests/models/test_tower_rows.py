"""The HF weight rows of the square towers (InternVL's, LLaVA-OneVision's): every tensor of transformers'
tiny model's vision side is read by exactly one row (SigLIP's post-layernorm too: carried, never run), and
sharding each at TP 2 and back gives the HF tensors bit for bit."""

from __future__ import annotations

import pytest
import torch

from loongforge.models.hf.weights import _fill
from loongforge.models.towers.intern_vit.hf_mapping import tower_rules as intern_vit_rules
from loongforge.models.towers.siglip.hf_mapping import tower_rules as siglip_rules
from tests.models import references

TP = 2
# tower -> (tiny HF model, our config, its rows, the HF prefixes of its vision side)
TOWERS = {
    "intern_vit": (references.internvl_hf_model, references.internvl_model_cfg, intern_vit_rules,
                   ("model.vision_tower.", "model.multi_modal_projector.")),
    "siglip": (references.llava_onevision_hf_model, references.llava_onevision_model_cfg, siglip_rules,
               ("model.vision_tower.", "model.multi_modal_projector.")),
}


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_rows_read_every_vision_tensor_and_round_trip_at_tp2(tower):
    hf_model, model_cfg, tower_rules, prefixes = TOWERS[tower]
    model_cfg = model_cfg()
    hf_state = hf_model(model_cfg).state_dict()
    read = set()
    for rule in tower_rules(model_cfg):
        indices = range(model_cfg.vision.depth) if "{i}" in rule.megatron else [None]
        for index in indices:
            names = [_fill(pattern, index) for pattern in rule.hf]
            tensors = [hf_state[name] for name in names]
            shards = [rule.transform.shard(tensors, rank, TP) for rank in range(TP)]
            back = rule.transform.unshard(shards)
            assert all(torch.equal(a, b) for a, b in zip(back, tensors)), names
            assert not read & set(names), names
            read |= set(names)
    vision_side = {key for key in hf_state if key.startswith(prefixes)}
    assert vision_side == read
