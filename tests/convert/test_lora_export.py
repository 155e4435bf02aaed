"""A LoRA run's checkpoint exports two ways (``convert.lora_export``), from a TP 2 run: the merged
model (``convert --to hf``, and the run's own ``checkpoint.save_hf``) gives the logits of transformers + PEFT with the exported adapter folder
(``--adapter``) on the HF base, which loads every adapter tensor; adapters PEFT cannot serve are
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from loongforge.cli.app import app
from loongforge.config.errors import InputError
from loongforge.config.schema import LoraConfig
from loongforge.convert.lora_export import ADAPTER_WEIGHTS, PEFT_PREFIX, CheckpointLora, refuse_unexportable
from loongforge.bench.lora import folder_bytes
from loongforge.convert.checkpoint_folders import weights_digest
from loongforge.convert.mcore_io import McoreReader
from loongforge.models.hf.state_dict_names import is_adapter_key
from loongforge.train.runner import check_lora_base
from tests.train.conftest import (
    SAVE_AT_END,
    SMALL_MODEL,
    final_checkpoint,
    losses,
    random_hf_folder,
    resume_from_copy,
    run_train,
)

PRESET = "llm-tiny-small-vocab"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two steps of LoRA (rank 4, a high rate so B moves far from 0) at TP 2 from a random HF base."""
    root = tmp_path_factory.mktemp("lora_export")
    random_hf_folder(PRESET, list(SMALL_MODEL), root / "base")
    run_train(root / "run", *RUN, f"checkpoint.load_hf={root / 'base'}", nproc=2, preset=PRESET)
    return root


RUN = ("lora.rank=4", "optimizer.lr=1e-2", "training.train_steps=2", "training.global_batch_size=2",
       "parallel.tensor_model_parallel_size=2", "checkpoint.save_interval=1", SAVE_AT_END, "checkpoint.save_hf=true")


def test_a_checkpoint_holds_the_adapters_and_names_its_base(lora_run):
    """The frozen base is not in the checkpoint (it is read again from checkpoint.load_hf, checked by
    its digest); the adapters and their Adam moments are, and a resume from step 1 is bit-identical."""
    step = final_checkpoint(lora_run / "run")
    tensors = McoreReader(step / "model_optim").tensors
    model_keys = [key for key in tensors if not key.startswith("optimizer.")]
    assert model_keys and all(is_adapter_key(key) for key in model_keys)
    recorded = json.loads((step / "meta.json").read_text())["lora_base"]
    assert recorded["kind"] == "hf" and recorded["digest"] == weights_digest(lora_run / "base")
    adapters, whole = folder_bytes(step), folder_bytes(lora_run / "run" / "hf")
    print(f"LoRA checkpoint {adapters:,} bytes; the model alone in bf16/fp32 as exported: {whole:,} bytes")
    resume_from_copy(lora_run / "run", lora_run / "resumed", 1, *RUN, f"checkpoint.load_hf={lora_run / 'base'}",
                     nproc=2, preset=PRESET)
    assert losses(lora_run / "resumed") == losses(lora_run / "run")


def test_a_resume_on_other_base_weights_is_one_line(tmp_path):
    step = tmp_path / "step_00000002"
    step.mkdir()
    base = {"kind": "hf", "path": "/models/base", "digest": "a", "rank": 4, "alpha": 16.0, "dropout": 0.0,
            "targets": ["language"], "modules": ["qkv"], "experts": False}
    (step / "meta.json").write_text(json.dumps({"step": 2, "lora_base": base}))
    with pytest.raises(InputError, match="trained on /models/base and this run's base is /models/other"):
        check_lora_base(step, {**base, "path": "/models/other", "digest": "b"})
    check_lora_base(step, {**base, "path": "/copies/base"})  # a moved copy with the same content resumes
    with pytest.raises(InputError, match="lora.rank=4 and this run has lora.rank=8"):
        check_lora_base(step, {**base, "rank": 8})
    (step / "meta.json").write_text(json.dumps({"step": 2}))
    with pytest.raises(InputError, match="holds a whole model, not LoRA adapters; .* set checkpoint.load_hf=DIR"):
        check_lora_base(step, base)


def _convert(*arguments: str) -> str:
    result = CliRunner().invoke(app, ["convert", *arguments, "--to", "hf", "--no-progress"])
    assert result.exit_code == 0, result.output
    return result.output


def test_merged_export_equals_peft_on_the_base(lora_run):
    import peft
    import transformers

    checkpoints = lora_run / "run" / "checkpoints"
    assert "LoRA adapters (rank 4, alpha 16) merged" in _convert(str(checkpoints), str(lora_run / "merged"))
    _convert(str(checkpoints), str(lora_run / "adapter"), "--adapter")
    input_ids = torch.randint(0, 4000, (1, 24), generator=torch.Generator().manual_seed(0))

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(input_ids).logits

    load = transformers.AutoModelForCausalLM.from_pretrained
    base = load(lora_run / "base", dtype=torch.float32)
    base_logits = logits(base)
    merged = logits(load(lora_run / "merged", dtype=torch.float32))
    with_adapters = peft.PeftModel.from_pretrained(base, lora_run / "adapter")
    written = load_file(str(lora_run / "adapter" / ADAPTER_WEIGHTS))
    loaded = {name: tensor for name, tensor in with_adapters.state_dict().items() if "lora_" in name}
    assert len(written) == len(loaded) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in 2 layers
    for name, tensor in written.items():  # every tensor landed in its module (PEFT inserts the adapter name)
        assert torch.equal(loaded[name.replace(".weight", ".default.weight")], tensor), name
    error, change = (merged - logits(with_adapters)).abs().max().item(), (merged - base_logits).abs().max().item()
    print(f"merged export vs transformers + PEFT: {error:.1e} (the adapters move the logits by {change:.2f})")
    assert error <= TOLERANCE and change > 100 * TOLERANCE
    assert all(name.startswith(PEFT_PREFIX) for name in written)
    # The run's own export (checkpoint.save_hf) is the same merged model.
    saved, converted = (load_file(str(folder / "model.safetensors")) for folder in (lora_run / "run" / "hf",
                                                                                    lora_run / "merged"))
    assert saved.keys() == converted.keys() and all(torch.equal(saved[k], converted[k]) for k in saved)


def test_adapters_serving_stacks_do_not_load_are_refused_in_one_line(tmp_path):
    vision = CheckpointLora(LoraConfig(rank=4, targets=["language", "vision"]), None)
    with pytest.raises(InputError, match="vision adapters, which serving stacks do not load as adapters"):
        refuse_unexportable(vision, None, [], tmp_path)
    experts = CheckpointLora(LoraConfig(rank=4, experts=True), None)

    class Model:
        family = "qwen3_vl"
    with pytest.raises(InputError, match="no PEFT module per expert"):
        refuse_unexportable(experts, Model, [], tmp_path)
