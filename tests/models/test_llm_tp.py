"""The text-only family at tensor parallel size 2 (two gloo processes) gives transformers' logits and
loss for Qwen2, Qwen3 (its per-head q/k norms see a different half of the heads on each rank) and
Llama; and one training step's gradients of the q/k norm weights are equal on both TP ranks."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.llm_helpers import ARCHITECTURES, build_hf_llm, text_positions, tiny_llm_cfg

TOLERANCE = 1e-5
WORLD_SIZE = 2
TIMEOUT_S = 240
LENGTH = 32


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.llm.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for arch, case in data.items():
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE)
        model = build_model(case["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                            post_process=True, device="cpu")
        load_hf_state_dict(model, case["hf_state"])
        with torch.no_grad():
            logits = model(input_ids=case["input_ids"], position_ids=text_positions(LENGTH))  # [1, s, V/2]
        loss = model(input_ids=case["input_ids"], position_ids=text_positions(LENGTH), labels=case["labels"])
        loss.sum().backward()
        shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
        dist.all_gather(shards, logits.contiguous())
        results[arch] = {"logits": torch.cat(shards, dim=-1), "loss": loss.detach(),
                         "q_norm_grad": _q_norm_grad(model)}
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {arch: r["q_norm_grad"] for arch, r in results.items()})
    if rank == 0:
        torch.save({"results": results, "q_norm_grads": gathered}, Path(workdir) / "outputs.pt")
    destroy_megatron()


def _q_norm_grad(model):
    """The first layer's q-norm gradient of this rank's heads (None without q/k norms)."""
    norm = model.language_model.decoder.layers[0].self_attention.q_layernorm
    weight = getattr(norm, "weight", None)
    return None if weight is None else weight.grad.clone()


def test_tp2_matches_transformers(tmp_path):
    cases, references = {}, {}
    for arch in ARCHITECTURES:
        model_cfg, hf_model = tiny_llm_cfg(arch), build_hf_llm(arch)
        generator = torch.Generator().manual_seed(7)
        input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
        labels = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
        cases[arch] = dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), input_ids=input_ids, labels=labels)
        references[arch] = hf_model
    torch.save(cases, tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    for arch, case in cases.items():
        hf_model = references[arch]
        vocab = case["model_cfg"].language.vocab_size
        hf_model.zero_grad()
        reference = hf_model(input_ids=case["input_ids"]).logits
        reference_loss = F.cross_entropy(reference[0], case["labels"][0], reduction="none")
        ours = outputs["results"][arch]
        assert (ours["logits"][..., :vocab] - reference.detach()).abs().max() <= TOLERANCE, arch
        assert (ours["loss"][0] - reference_loss.detach()).abs().max() <= TOLERANCE, arch
        if arch == "qwen3":
            # Each rank normalises its own heads with the one shared weight: the gradient of the
            # weight sums both ranks' heads (megatron all-reduces it in finalize_model_grads);
            # before that reduction the two ranks' parts add up to transformers' full gradient.
            reference_loss.sum().backward()
            hf_grad = hf_model.model.layers[0].self_attn.q_norm.weight.grad
            rank_grads = [grads[arch] for grads in outputs["q_norm_grads"]]
            assert not torch.allclose(rank_grads[0], rank_grads[1])
            assert (rank_grads[0] + rank_grads[1] - hf_grad).abs().max() <= TOLERANCE
