"""``hf_rules.FusedExperts``: an HF tensor holding every expert of a layer (Qwen3-VL-MoE) <-> one
megatron tensor per expert, at TP 1 and 2, from both orientations; the same per-expert tensors as
the per-expert Hub layout (Qwen3-MoE's ``GateUp`` / ``Split(1)`` rows) gives."""

import pytest
import torch

from loongforge.models.hf.rules import FusedExperts, GateUp, Split

EXPERTS, HIDDEN, FFN = 3, 8, 6


def _gate_up_and_down():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g)  # transformers 5: [E, 2*ffn, h]
    down = torch.randn(EXPERTS, HIDDEN, FFN, generator=g)  # [E, h, ffn]
    fused_gate_up = FusedExperts(GateUp(), EXPERTS, (2 * FFN, HIDDEN), parts=2)
    fused_down = FusedExperts(Split(1), EXPERTS, (HIDDEN, FFN), parts=1)
    return gate_up, down, fused_gate_up, fused_down


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("hub_layout", [False, True], ids=["transformers5", "hub"])
def test_each_expert_shards_as_the_per_expert_layout_and_back(tp, hub_layout):
    gate_up, down, fused_gate_up, fused_down = _gate_up_and_down()
    stored_gate_up, stored_down = (gate_up.transpose(1, 2), down.transpose(1, 2)) if hub_layout else (gate_up, down)
    for rank in range(tp):
        for e in range(EXPERTS):
            gate, up = gate_up[e].chunk(2)
            assert torch.equal(fused_gate_up.shard_expert([stored_gate_up], e, rank, tp), GateUp().shard([gate, up], rank, tp))
            assert torch.equal(fused_down.shard_expert([stored_down], e, rank, tp), Split(1).shard([down[e]], rank, tp))
    # [expert][rank] -> the fused tensor, always in transformers 5's layout
    for fused, stored, original in ((fused_gate_up, stored_gate_up, gate_up), (fused_down, stored_down, down)):
        shards = [[fused.shard_expert([stored], e, rank, tp) for rank in range(tp)] for e in range(EXPERTS)]
        (back,) = fused.unshard_experts(shards)
        assert torch.equal(back, original)
        per_rank = [fused.shard([stored], rank, tp) for rank in range(tp)]  # [E, ...] per rank
        assert torch.equal(fused.unshard(per_rank)[0], original)


def test_a_square_slice_reads_as_transformers_5_holds_it():
    """[E, 2*ffn, h] with 2*ffn == h could be either layout; transformers 5 loads it untransposed."""
    square = torch.randn(EXPERTS, 8, 8)
    fused = FusedExperts(GateUp(), EXPERTS, (8, 8), parts=2)
    gate, up = square[1].chunk(2)
    assert torch.equal(fused.shard_expert([square], 1, 0, 1), torch.cat([gate, up]))


def test_shapes_it_reads_and_a_loud_error_for_others():
    _, down, _, fused_down = _gate_up_and_down()
    assert fused_down.accepts_hf_shape((EXPERTS, FFN, HIDDEN)) and fused_down.accepts_hf_shape((EXPERTS, HIDDEN, FFN))
    assert not fused_down.accepts_hf_shape((EXPERTS + 1, HIDDEN, FFN))
    with pytest.raises(ValueError, match=r"fused expert tensor of shape \[3, 8, 5\]: expected \[3, 8, 6\]"):
        fused_down.shard_expert([down[..., :5]], 0, 0, 1)
    with pytest.raises(ValueError, match=r"fused expert tensor of shape \[2, 8, 6\]"):
        fused_down.shard_expert([down[:2]], 0, 0, 1)
