"""DeepSeek-V3 and V2 at tensor parallel size 2 (two gloo processes): multi-latent attention split by
head (the latent down-projections column-parallel and gathered), the experts and the shared experts
split over the ranks, the router replicated with its expert bias; with and without sequence
parallelism, logits, per-token loss and the latent down-projection's gradient equal transformers'."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.llm_helpers import DEEPSEEK_ARCHITECTURES, build_hf_llm, text_positions, tiny_llm_cfg

TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
WORLD_SIZE = 2
TIMEOUT_S = 240
LENGTH = 32


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.llm.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    cases = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for arch, case in cases.items():
        for sequence_parallel in (False, True):
            parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                          sequence_parallel=sequence_parallel)
            model = build_model(case["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                                post_process=True, device="cpu").eval()
            load_hf_state_dict(model, case["hf_state"])
            with torch.no_grad():
                logits = model(input_ids=case["input_ids"], position_ids=text_positions(LENGTH))  # [1, s, V/2]
            loss = model(input_ids=case["input_ids"], position_ids=text_positions(LENGTH), labels=case["labels"])
            loss.sum().backward()
            shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
            dist.all_gather(shards, logits.contiguous())
            # The latent down-projection's gradient, its rows split over TP (the shared rotary key's last).
            weight = model.language_model.decoder.layers[0].self_attention.linear_kv_down_proj.weight
            grad = weight.main_grad if getattr(weight, "main_grad", None) is not None else weight.grad
            grads = [torch.empty_like(grad) for _ in range(WORLD_SIZE)]
            dist.all_gather(grads, grad.contiguous())
            results[(arch, sequence_parallel)] = {"logits": torch.cat(shards, dim=-1), "loss": loss.detach(),
                                                  "kv_down_grad": torch.cat(grads, dim=0)}
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def test_tp2_with_and_without_sp_matches_transformers(tmp_path):
    cases, references = {}, {}
    for arch in DEEPSEEK_ARCHITECTURES:
        model_cfg, hf_model = tiny_llm_cfg(arch), build_hf_llm(arch)
        generator = torch.Generator().manual_seed(7)
        input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
        labels = torch.randint(0, model_cfg.language.vocab_size, (1, LENGTH), generator=generator)
        cases[arch] = dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), input_ids=input_ids, labels=labels)
        logits = hf_model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits[0], labels[0], reduction="none")
        loss.sum().backward()
        grad = hf_model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad
        references[arch] = (logits.detach(), loss.detach(), grad)
    torch.save(cases, tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    assert len(outputs) == 2 * len(DEEPSEEK_ARCHITECTURES)
    for (arch, sequence_parallel), ours in outputs.items():
        reference, reference_loss, reference_grad = references[arch]
        vocab = reference.shape[-1]
        logit_diff = (ours["logits"][..., :vocab] - reference).abs().max().item()
        loss_diff = (ours["loss"][0] - reference_loss).abs().max().item()
        # Relative to the largest entry; the rotary rows (the last 8) took only one rank's heads' share
        # before the fix (mcore_patches.mla_rotary_scope).
        grad_diff = ((ours["kv_down_grad"] - reference_grad).abs().max() / reference_grad.abs().max()).item()
        print(f"{arch} TP 2 SP {sequence_parallel}: max |logit diff| {logit_diff:.2e}, loss {loss_diff:.2e}, "
              f"kv_a_proj_with_mqa gradient {grad_diff:.2e} (relative)")
        assert logit_diff <= TOLERANCE and loss_diff <= TOLERANCE, (arch, sequence_parallel)
        assert grad_diff <= GRAD_TOLERANCE, (arch, sequence_parallel, grad_diff)
