"""Qwen3-MoE at tensor parallel size 2 (two gloo processes), without and with sequence parallelism:
every expert split over the two ranks (no expert parallelism yet), the all-gather dispatcher
gathering the tokens, gives transformers' logits and per-token loss; so does the model loaded from
``loongforge convert``'s TP-2 megatron checkpoint (each rank's expert shards where megatron-core's
sharded state dict puts them). The training step gives the balance loss the same gradient as on
one process (megatron-core alone would divide it by the TP size: ``moe_balance``)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.llm_helpers import (
    answer_masked_row,
    build_hf_llm,
    expected_balance_grad,
    router_grad,
    text_positions,
    tiny_llm_cfg,
)

TOLERANCE = 1e-5
WORLD_SIZE = 2
TIMEOUT_S = 240
LENGTH = 32
ARCH = "qwen3_moe"
BALANCE_COEFFICIENT = 0.5


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.llm.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    case = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for sequence_parallel, source in ((False, "hf"), (True, "hf"), (True, "mcore")):
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                      sequence_parallel=sequence_parallel)
        model = build_model(case["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                            post_process=True, device="cpu").eval()
        if source == "hf":
            load_hf_state_dict(model, case["hf_state"])
        else:
            from loongforge.train.checkpoint import load_checkpoint

            load_checkpoint(Path(workdir) / "mcore", [model], optimizer=None, scheduler=None)
        with torch.no_grad():
            logits = model(input_ids=case["input_ids"], position_ids=text_positions(LENGTH))  # [1, s, V/2]
            loss = model(input_ids=case["input_ids"], position_ids=text_positions(LENGTH), labels=case["labels"])
        shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
        dist.all_gather(shards, logits.contiguous())
        results[(sequence_parallel, source)] = {"logits": torch.cat(shards, dim=-1), "loss": loss}
    # megatron-core trains MoE at TP > 1 only with sequence parallelism (config validation says so).
    results["balance"] = _balance_grad(case, sequence_parallel=True, is_loss_rank=rank == 0)
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def _balance_grad(case: dict, sequence_parallel: bool, is_loss_rank: bool) -> torch.Tensor:
    """The last router's balance-loss gradient after one training step on ``case``'s row."""
    from megatron.core.transformer.moe.router import TopKRouter

    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.llm.model import build_model
    from loongforge.train.runner import wrap_for_training

    parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                  sequence_parallel=sequence_parallel)
    model = build_model(case["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu")
    load_hf_state_dict(model, case["hf_state"])
    chunks, _ = wrap_for_training(model.train(), parallel_cfg)
    router = [m for m in model.modules() if isinstance(m, TopKRouter)][-1]
    rows = [case["row"]]
    with_balance, _ = router_grad(chunks, router, rows, BALANCE_COEFFICIENT, is_loss_rank)
    without_balance, _ = router_grad(chunks, router, rows, 0.0, is_loss_rank)
    return with_balance - without_balance


def _hf_balance_grad(hf_model, row: dict) -> torch.Tensor:
    """The same gradient from transformers' last-layer router input (one process, the whole row)."""
    gate = hf_model.model.layers[-1].mlp.gate
    inputs = []
    handle = gate.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
    with torch.no_grad():
        hf_model(input_ids=row["input_ids"])
    handle.remove()
    return expected_balance_grad(gate.weight, inputs, hf_model.config.num_experts_per_tok, BALANCE_COEFFICIENT)


def test_tp2_matches_transformers(tmp_path):
    from loongforge.convert.engine import hf_to_mcore

    model_cfg, hf_model = tiny_llm_cfg(ARCH), build_hf_llm(ARCH)
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tp=WORLD_SIZE, progress=False)
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
    labels = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
    row = answer_masked_row(LENGTH, LENGTH // 3, seed=3, packed=False)
    torch.save(dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), input_ids=input_ids, labels=labels,
                    row=row), tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids).logits
    reference_loss = F.cross_entropy(reference[0], labels[0], reduction="none")
    vocab = model_cfg.language.vocab_size
    expected_balance = _hf_balance_grad(hf_model, row)
    balance = outputs.pop("balance")
    assert (balance - expected_balance).abs().max() <= 1e-5 * float(expected_balance.abs().max())
    assert len(outputs) == 3
    for case, ours in outputs.items():
        assert (ours["logits"][..., :vocab] - reference).abs().max() <= TOLERANCE, case
        assert (ours["loss"][0] - reference_loss).abs().max() <= TOLERANCE, case
