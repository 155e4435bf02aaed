"""Preference training at one process (issue 55): step 1 of ``loongforge train --preset llm-tiny ...
preference.loss=...`` on pairs of LLaMA-Factory's dpo_en_demo.json equals transformers + TRL.

The reference computation is independent of loongforge's model and data code: TRL tokenizes each pair
(its DPOTrainer's prompt / completion split, with the family's chat template), the transformers models
loaded from the same HF folders give the per-token log-probs, and TRL's own loss code
(``DPOTrainer._compute_loss``, ``ORPOTrainer.odds_ratio_loss``) turns them into the loss and metrics.
The policy differs from the reference (a perturbed copy), so the rewards are not zero; the step's four
pairs fill two packed rows, so the step's gradient (its norm, against transformers' autograd through TRL's
loss) shows the loss normalised over micro-batches as it must be.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from trl.data_utils import _tokenize, common_prefix_length
from trl.experimental.orpo import ORPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer

from loongforge.config.loader import load_run_config
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.registry import get_family
from tests.shared_data import SHARED_DATA
from tests.train.conftest import random_hf_folder, resume_from_copy, run_train
from tests.train.test_preference_loss import OneProcessAccelerator

PRESET = "llm-tiny"
MODEL = ("model.language.num_layers=2",)
# The four shortest pairs of the demo (144-164 tokens a pair with Qwen3's template): two rows of 384.
PAIRS = (21, 102, 134, 269)
BETA = 0.5
TOLERANCE = 1e-5
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(policy HF folder, reference HF folder: the policy perturbed, the pairs file)."""
    root = tmp_path_factory.mktemp("preference")
    policy, reference = root / "policy", root / "reference"
    random_hf_folder(PRESET, list(MODEL), policy)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(reference)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (policy / name).exists():
            shutil.copy(policy / name, reference / name)
    records = json.loads((SHARED_DATA / "llamafactory" / "dpo_en_demo.json").read_text())
    pairs = root / "pairs.json"
    pairs.write_text(json.dumps([records[index] for index in PAIRS]))
    return policy, reference, pairs


def _trl_inputs(pairs: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPOTrainer's batch: ids [2P, L] (chosen rows, then rejected), attention and completion masks."""
    model_cfg = load_run_config(PRESET).model
    tokenizer = load_tokenizer("qwen3", get_family(model_cfg.family).chat(model_cfg).jinja_template)
    rows = []
    records = json.loads(pairs.read_text())
    for side in ("chosen", "rejected"):
        for record in records:
            prompt = [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]}
                      for m in record["conversations"]]
            completion = [{"role": "assistant", "content": record[side]["value"]}]
            prompt_ids = _tokenize(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
            full_ids = _tokenize(tokenizer, prompt + completion)["input_ids"]
            rows.append((full_ids, common_prefix_length(prompt_ids, full_ids)))
    length = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (full_ids, start) in enumerate(rows):
        ids[row, :len(full_ids)] = torch.tensor(full_ids)
        attention[row, :len(full_ids)] = 1
        completion[row, start:len(full_ids)] = 1
    return ids, attention, completion


def _token_logps(model, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """float64 [2P, L-1]: log p of each next token under the transformers ``model``."""
    logits = model(input_ids=ids, attention_mask=attention).logits.double()  # [2P, L, V]
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def _hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _grad_norm(model) -> float:
    """The gradient's global 2-norm over every parameter (what the run logs before clipping)."""
    return float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()
                                                        if p.grad is not None])))


def _trl_dpo(loss_type: str, rpo_alpha: float, policy: torch.Tensor, reference: torch.Tensor,
             completion: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """DPOTrainer._compute_loss on the transformers models' log-probs (a stand-in trainer and model); with
    ``rpo_alpha`` TRL's RPO: loss_type [loss_type, "sft"], loss_weights [1, rpo_alpha]."""
    mask = completion[:, 1:].double()
    per_token = policy * mask
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    ref = (reference * mask).sum(1)
    pairs = len(ref) // 2
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=OneProcessAccelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type, "sft"],
        loss_weights=[1.0, rpo_alpha],
        beta=BETA, label_smoothing=0.0, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": torch.zeros_like(completion), "attention_mask": torch.ones_like(completion),
              "completion_mask": completion, "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}
    loss = DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)
    return {"loss": float(loss), **{name: trainer._metrics["train"][name][0] for name in METRICS}}, loss


def _trl_orpo(policy: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """ORPOTrainer's loss: the chosen sequences' NLL (prompt and answer) minus odds_ratio_loss's mean."""
    mask = completion[:, 1:].double()
    sums, tokens = (policy * mask).sum(1), mask.sum(1)
    pairs = len(sums) // 2
    averages = sums / tokens
    trainer = SimpleNamespace(beta=BETA, accelerator=OneProcessAccelerator())
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(trainer, averages[:pairs],
                                                                                 averages[pairs:])
    sequence = attention[:pairs, 1:].double()  # every predicted token of the chosen sequences
    nll = -(policy[:pairs] * sequence).sum() / sequence.sum()
    loss = nll - losses.mean()
    return {"loss": float(loss), "rewards/chosen": float(chosen_rewards.mean()),
            "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
            "logps/chosen": float(sums[:pairs].mean()), "logps/rejected": float(sums[pairs:].mean()),
            "nll_loss": float(nll)}, loss


@pytest.mark.parametrize("loss, rpo_alpha", [("sigmoid", 0.5), ("orpo", 0.0)])
def test_step_one_equals_transformers_and_trl(tmp_path, folders, loss, rpo_alpha):
    """DPO (+ rpo_alpha x the chosen completions' NLL) with the perturbed reference, and ORPO (no reference;
    its NLL over the chosen prompts and answers): step 1's loss and metrics equal TRL's on the transformers
    models' log-probs, under TRL's names in the metrics row. The other losses take the same sums
    (tests/train/test_preference_loss.py proves each formula against TRL)."""
    policy, reference, pairs = folders
    reference_option = () if loss == "orpo" else (f"preference.reference={reference}",)
    run_train(tmp_path, *MODEL, "data.seq_len=384", "training.global_batch_size=4", "training.train_steps=1",
              "logging.log_interval=1", "logging.progress_bar=false", "logging.tensorboard=false",
              "checkpoint.save_at_end=false", "data.source=files", f"data.paths=[{pairs}]", "data.shuffle=false",
              f"checkpoint.load_hf={policy}", f"preference.loss={loss}", f"preference.beta={BETA}",
              f"preference.rpo_alpha={rpo_alpha}", *reference_option, preset=PRESET, options=())
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    ids, attention, completion = _trl_inputs(pairs)
    model = _hf_model(policy)
    policy_logps = _token_logps(model, ids, attention)
    if loss == "orpo":
        expected, loss_tensor = _trl_orpo(policy_logps, attention, completion)
    else:
        with torch.no_grad():
            reference_logps = _token_logps(_hf_model(reference), ids, attention)
        expected, loss_tensor = _trl_dpo(loss, rpo_alpha, policy_logps, reference_logps, completion)
    loss_tensor.backward()  # the step's gradient: its norm checks the normalisation over the two rows
    expected["grad_norm"] = _grad_norm(model)
    gaps = {name: abs(row[name] - value) / (1 if name != "grad_norm" else value) for name, value in expected.items()}
    print(f"{loss}: step 1 loss {row['loss']:.6f} (TRL {expected['loss']:.6f}), rewards/chosen "
          f"{row['rewards/chosen']:.5f}, rewards/margins {row['rewards/margins']:.5f}, grad_norm {row['grad_norm']:.5f} "
          f"(transformers {expected['grad_norm']:.5f}); largest gap {max(gaps.values()):.1e} "
          f"({max(gaps, key=gaps.get)}; grad_norm's relative)")
    assert max(gaps.values()) <= TOLERANCE
    assert not math.isclose(row["loss"], math.log(2), abs_tol=1e-3)  # the reference is not the policy
    assert "nll_loss" in row and row["rewards/accuracies"] in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_default_reference_is_the_starting_weights_and_a_resume_is_exact(tmp_path, folders):
    """No preference.reference: the reference is a frozen copy of the starting weights (checkpoint.load_hf), so
    step 1's DPO loss is exactly ln 2 with zero rewards. Resumed after step 1, the run reads its reference
    from checkpoint.load_hf again and its data position from the checkpoint: step 2 is the same."""
    policy, _, pairs = folders
    options = (*MODEL, "data.seq_len=384", "training.global_batch_size=2", "training.train_steps=2",
               "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_at_end=false",
               "checkpoint.save_interval=1", "data.source=files", f"data.paths=[{pairs}]", "data.shuffle=false",
               f"checkpoint.load_hf={policy}", "preference.loss=sigmoid")
    run = tmp_path / "run"
    run_train(run, *options, preset=PRESET, options=())
    first, second = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:2])
    resume_from_copy(run, tmp_path / "resumed", 1, *options, preset=PRESET, options=())
    resumed = json.loads((tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()[1])
    print(f"default reference: step 1 loss {first['loss']!r} (ln 2 = {math.log(2)!r}); step 2 loss {second['loss']:.8f}, "
          f"resumed {resumed['loss']:.8f}")
    assert abs(first["loss"] - math.log(2)) < 1e-12 and first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert first["rewards/accuracies"] == 0.0 and second["rewards/chosen"] != 0.0
    assert all(resumed[name] == pytest.approx(second[name], rel=1e-9, abs=1e-12)
               for name in ("loss", "grad_norm", *METRICS))
