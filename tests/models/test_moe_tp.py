"""Qwen3-MoE at tensor parallel size 2 (two gloo processes), without and with sequence parallelism:
every expert split over the two ranks (no expert parallelism yet), the all-gather dispatcher
gathering the tokens, gives transformers' logits and per-token loss; so does the model loaded from
``loongforge convert``'s TP-2 megatron checkpoint (each rank's expert shards where megatron-core's
sharded state dict puts them)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.llm_helpers import build_hf_llm, text_positions, tiny_llm_cfg

TOLERANCE = 1e-5
WORLD_SIZE = 2
TIMEOUT_S = 240
LENGTH = 32
ARCH = "qwen3_moe"


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf_weights import load_hf_state_dict
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
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def test_tp2_matches_transformers(tmp_path):
    from loongforge.convert.engine import hf_to_mcore

    model_cfg, hf_model = tiny_llm_cfg(ARCH), build_hf_llm(ARCH)
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tp=WORLD_SIZE, progress=False)
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
    labels = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
    torch.save(dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), input_ids=input_ids, labels=labels),
               tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids).logits
    reference_loss = F.cross_entropy(reference[0], labels[0], reduction="none")
    vocab = model_cfg.language.vocab_size
    assert len(outputs) == 3
    for case, ours in outputs.items():
        assert (ours["logits"][..., :vocab] - reference).abs().max() <= TOLERANCE, case
        assert (ours["loss"][0] - reference_loss).abs().max() <= TOLERANCE, case
