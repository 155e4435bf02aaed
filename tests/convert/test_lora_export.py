"""A LoRA run's checkpoint exports two ways (``convert.lora_export``), from a TP 2 run: the merged
model (``convert --to hf``, and the run's own ``checkpoint.save_hf``) gives the logits of transformers + PEFT with the exported adapter folder
(``--adapter``) on the HF base, which loads every adapter tensor; adapters PEFT cannot serve are
refused in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from loongforge.cli.app import app
from loongforge.config.errors import InputError
from loongforge.config.schema import LoraConfig
from loongforge.convert.lora_export import ADAPTER_WEIGHTS, PEFT_PREFIX, CheckpointLora, refuse_unexportable
from tests.train.conftest import SAVE_AT_END, SMALL_MODEL, random_hf_folder, run_train

PRESET = "llm-tiny-small-vocab"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two steps of LoRA (rank 4, a high rate so B moves far from 0) at TP 2 from a random HF base."""
    root = tmp_path_factory.mktemp("lora_export")
    random_hf_folder(PRESET, list(SMALL_MODEL), root / "base")
    run_train(root / "run", "lora.rank=4", "optimizer.lr=1e-2", f"checkpoint.load_hf={root / 'base'}",
              "training.train_steps=2", "training.global_batch_size=2", "parallel.tensor_model_parallel_size=2",
              SAVE_AT_END, "checkpoint.save_hf=true", nproc=2, preset=PRESET)
    return root


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
