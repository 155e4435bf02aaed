"""``loongforge train ... lora.rank=8``: the run builds adapters on the chosen towers and trains them
alone, and the same adapters train alike at TP 2 with sequence parallelism as in one process (their
initial A does not depend on the TP size; their gradients, summed over TP where the tokens are
split, and their gradient norm, counting each shard once, are the same); a TP 2 checkpoint of them
resumes in one process."""

from tests.train.conftest import assert_close_relative, grad_norms, losses, resume_from_copy, run_recorded

LORA = ("lora.rank=8", "lora.targets=[language,vision,projector]", "training.train_steps=3",
        "optimizer.lr=1e-3")
LINE = ("lora: language.fc1 2, language.fc2 2, language.proj 2, language.qkv 2, projector.fc1 1, projector.fc2 1, "
        "vision.fc1 2, vision.fc2 2, vision.proj 2, vision.qkv 2;")


def test_lora_trains_alike_at_tp2_with_sequence_parallelism(tmp_path):
    """Also with ``parallel.encoder_dp=tp`` (the vision adapters' gradients are summed over the TP
    ranks that divided the images, as the tower's are) and at PP 2 (the initial A of a layer follows
    its global index)."""
    alone = run_recorded(tmp_path / "tp1", *LORA, nproc=1)
    assert LINE in alone
    assert "61,440 trainable parameters" in alone  # the adapters alone (the model holds 1.25M)
    assert losses(tmp_path / "tp1")[-1] < losses(tmp_path / "tp1")[0]
    tp2 = ("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")
    layouts = {"tp2": (*tp2, "checkpoint.save_interval=2"),
               "tp2_encoder_dp": (*tp2, "parallel.encoder_dp=tp", "parallel.vision_tensor_model_parallel_size=1"),
               "pp2": ("parallel.pipeline_model_parallel_size=2",)}  # each stage numbers its layers from 0
    for name, extra in layouts.items():
        output = run_recorded(tmp_path / name, *LORA, *extra, nproc=2)
        assert "lora: language" in output
        assert_close_relative(losses(tmp_path / name), losses(tmp_path / "tp1"), 1e-5, f"LoRA losses {name} vs TP1")
        assert_close_relative(grad_norms(tmp_path / name), grad_norms(tmp_path / "tp1"), 1e-5,
                              f"LoRA grad norms {name} vs TP1")
    # The TP 2 run's checkpoint at step 2 resumed in one process: the split adapter matrices (fc1's B
    # as two halves, like the fused gate/up weight) and their Adam moments reshard to TP 1.
    resume_from_copy(tmp_path / "tp2", tmp_path / "resumed_tp1", 2, *LORA)
    assert_close_relative(losses(tmp_path / "resumed_tp1"), losses(tmp_path / "tp1"), 1e-5,
                          "LoRA losses, TP2 checkpoint resumed at TP1, vs TP1")
