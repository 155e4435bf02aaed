"""``loongforge train`` through typer's CliRunner: listing, showing, dry runs, usage errors."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from loongforge.cli.app import app
from loongforge.config.loader import load_run_config
from loongforge.config.presets import list_preset_names

runner = CliRunner()
PRESETS = list_preset_names()


def invoke(*args: str):
    return runner.invoke(app, ["train", *args])


def assert_usage_error(result, *fragments: str) -> list[str]:
    """Exit code 2, and only `error: ...` lines, one per problem."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    for fragment in fragments:
        assert any(fragment in line for line in lines), (fragment, lines)
    return lines


def test_list_presets_shows_a_row_per_preset_with_size_layout_and_seq_len():
    result = invoke("--list-presets")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()[2:]
    rows = {line.split()[0]: line for line in lines if line.strip() and not line.startswith("[family")}
    for name in PRESETS:
        assert name in rows
    # Grouped by family: each family's header (in name order), then only its presets.
    families = [line[len("[family "):-1] for line in lines if line.startswith("[family")]
    assert families == sorted(families) and len(families) == len(set(families)) >= 7
    family = None
    for line in lines:
        if line.startswith("[family"):
            family = line[len("[family "):-1]
        elif line.strip() and line.split()[0] in PRESETS:
            assert load_run_config(line.split()[0]).model.family == family, line
    assert "8.19B" in rows["qwen3-8b"] and "8.03B" in rows["llama3.1-8b"] and "8.77B" in rows["qwen3vl-8b"]
    assert "LM 48x2048 MoE 128e top-8" in rows["qwen3-30b-a3b"] and "30.53B" in rows["qwen3-30b-a3b"]
    assert "8.29B" in rows["qwen2.5vl-7b"] and "TP2 x PP1 x DP4" in rows["qwen2.5vl-7b"]
    assert "16384" in rows["qwen2.5vl-7b"]
    assert "73.41B" in rows["qwen2.5vl-72b"] and "TP8 x PP2 x DP2" in rows["qwen2.5vl-72b"]
    assert "3.75B" in rows["qwen2.5vl-3b"] and "33.45B" in rows["qwen2.5vl-32b"]


def test_show_preset_prints_composed_yaml():
    import yaml

    result = invoke("--show-preset", "qwen2.5vl-3b")
    assert result.exit_code == 0, result.output
    tree = yaml.safe_load(result.stdout)
    assert tree["model"]["vision"]["depth"] == 32  # from the vision component
    assert tree["model"]["language"]["hidden_size"] == 2048  # from the language component
    assert tree["training"]["precision"] == "bf16"  # from the training component
    assert "components" not in tree and tree["preset"] == "qwen2.5vl-3b"


def test_show_unknown_preset_is_a_usage_error():
    assert_usage_error(invoke("--show-preset", "qwen2.5vl-8b"), "did you mean")


@pytest.mark.parametrize("name", PRESETS)
def test_dry_run_every_preset_at_its_default_layout(name):
    import yaml

    result = invoke("--preset", name, "--dry-run")
    assert result.exit_code == 0, result.output
    resolved, plan = result.stdout.split("parallel plan\n")
    assert yaml.safe_load(resolved)["preset"] == name
    for label in ("world size", "tensor parallel", "pipeline parallel", "data parallel",
                  "micro-batches", "stage 0", "DP balancing", "memory per rank"):
        assert label in plan
    balancing = next(line for line in plan.splitlines() if "DP balancing" in line)
    # On in every full-size preset (losses are the same with it on or off), off in the tiny ones.
    assert ("tiny" in name) == ("off (balance.enabled=false)" in balancing), balancing
    if "tiny" not in name:
        assert "on, manifest mode over DP" in balancing and "fitted online from steps 3-22" in balancing


def test_dry_run_72b_plan_numbers():
    plan = invoke("--preset", "qwen2.5vl-72b", "--dry-run").stdout.split("parallel plan\n")[1]
    assert "32 processes = TP8 x PP2 x DP2" in plan
    assert "(vision encoder: 8)" in plan
    assert "64 per rank per step" in plan
    # VP 4: each rank holds every other 10-layer chunk
    assert "layers 0-9, 20-29, 40-49, 60-69 (40)" in plan and "layers 10-19, 30-39, 50-59, 70-79 (40)" in plan
    assert "73,410,777,344" in plan
    assert "GiB" in plan


def test_dry_run_moe_plan_splits_the_experts_over_ep():
    """qwen3-30b-a3b at EP 8 over 16 ranks: a rank holds the dense part whole (TP 1) and 1/8 of
    the routed experts; the experts' optimizer state is sharded over their 2 replicas only."""
    plan = invoke("--preset", "qwen3-30b-a3b", "--dry-run").stdout.split("parallel plan\n")[1]
    assert "16 processes = TP1 x PP1 x DP16" in plan
    assert "EP8 x expert TP1 x expert DP2" in plan
    assert "30.53B total (30,532,122,624), 3.35B active per token" in plan
    experts = 48 * 128 * 3 * 2048 * 768  # routed experts, all layers
    dense = 30_532_122_624 - experts
    assert "5.16B params per rank" in plan  # dense + experts / 8
    # bf16 + fp32 grads + (fp32 master + Adam) / 16 for the dense part, / 2 for the experts.
    memory = dense * (2 + 4 + 12 / 16) + experts / 8 * (2 + 4 + 12 / 2)
    assert f"~{memory / 1024**3:.1f} GiB" in plan and "6.75 bytes/param (routed experts 12.00)" in plan


def test_dry_run_235b_moe_vl_plan_fits_with_expert_parallelism():
    plan = invoke("--preset", "qwen3vl-235b-a22b", "--dry-run").stdout.split("parallel plan\n")[1]
    assert "128 processes = TP4 x PP2 x DP16" in plan
    assert "EP32 x expert TP1 x expert DP2" in plan
    assert "235.67B total (235,670,022,896), 22.77B active per token" in plan
    # The preset's layout: VP 4, one layer fewer beside the vision encoder
    assert "layers 0-10, 23-33, 46-57, 70-81 (46)" in plan and "layers 11-22, 34-45, 58-69, 82-93 (48)" in plan
    assert "~46.9 GiB" in plan  # without EP: ~206 GiB; 48 layers on the last rank


def test_dry_run_397b_hybrid_moe_plan_fits_80gb_gpus():
    """Qwen3.5-397B-A17B: 60 hybrid layers over PP4, TP2, EP64 (8 of every layer's 512 experts a rank), full
    recompute; a middle stage's parameters per rank counted here by layer type, and the plan fits at CP 1."""
    from loongforge.config.loader import load_run_config
    from loongforge.models.decoder.params import expert_parameters, language_layer_parameters

    out = invoke("--preset", "qwen3.5-397b-a17b", "--dry-run").stdout
    plan = out.split("parallel plan\n")[1]
    assert "256 processes = TP2 x PP4 x DP32" in plan and "EP64 x expert TP1 x expert DP1" in plan
    assert "396.80B total (396,802,360,816)" in plan
    lang = load_run_config("qwen3.5-397b-a17b").model.language
    stage = [lang.layer_types[i] for i in range(15, 30)]  # stage 1: 11 linear-attention, 4 full-attention layers
    experts = expert_parameters(lang)
    per_rank = sum((language_layer_parameters(lang, layer_type=kind) - experts) / 2 + experts / 64 for kind in stage)
    assert f"layers 15-29 (15): {per_rank / 1e9:.2f}B params per rank" in plan
    cp1 = next(line for line in out.splitlines() if line.strip().startswith("1  TP2 x PP4 x DP32"))
    total = float(cp1.split()[-2])
    print(f"\nqwen3.5-397b-a17b: stage 1 {per_rank / 1e9:.2f}B params per rank; CP 1 plan {total} GiB per rank")
    assert cp1.split()[-1] == "yes" and total <= 72.0


def test_dry_run_deepseek_v3_plan_fits_80gb_gpus():
    """DeepSeek-V3 (671B): 61 layers over PP 8 (7 | 8 x 6 | 6), EP 64 (4 of every layer's 256 experts a rank),
    TP 1, full recompute. Each stage's parameters per rank counted here layer by layer (the first 3 layers
    dense, with no experts), the FLOPs of a dense and a sparse layer, and the plan fits at CP 1."""
    from loongforge.config.loader import load_run_config
    from loongforge.models.decoder.params import expert_parameters, language_layer_parameters

    out = invoke("--preset", "deepseek-v3", "--dry-run").stdout
    plan = out.split("parallel plan\n")[1]
    assert "512 processes = TP1 x PP8 x DP64" in plan and "EP64 x expert TP1 x expert DP1" in plan
    assert "671.03B total (671,026,404,352), 37.55B active per token" in plan
    lang = load_run_config("deepseek-v3").model.language
    experts = expert_parameters(lang)

    def layer(index: int) -> float:  # this rank's share of decoder layer ``index``
        sparse = index >= 3
        return language_layer_parameters(lang, sparse=sparse) - (experts - experts / 64 if sparse else 0)

    embedding = lang.vocab_size * lang.hidden_size
    bounds = [(0, 7), (7, 15), (15, 23), (23, 31), (31, 39), (39, 47), (47, 55), (55, 61)]
    stages = [sum(layer(i) for i in range(first, end)) for first, end in bounds]
    stages[0] += embedding
    stages[-1] += embedding + lang.hidden_size  # the LM head and the final norm
    assert f"layers 0-6 (7) + embeddings: {stages[0] / 1e9:.2f}B params per rank" in plan
    assert f"layers 7-14 (8): {stages[1] / 1e9:.2f}B params per rank" in plan
    assert f"layers 55-60 (6) + LM head: {stages[-1] / 1e9:.2f}B params per rank" in plan
    cp1 = next(line for line in out.splitlines() if line.strip().startswith("1  TP1 x PP8 x DP64"))
    total = float(cp1.split()[-2])
    print(f"\ndeepseek-v3: stages {[round(x / 1e9, 2) for x in stages]}B params per rank; CP 1 plan {total} GiB "
          f"per rank")
    assert cp1.split()[-1] == "yes" and total <= 72.0


def test_dry_run_states_the_encoders_activations_per_rank_in_every_mode():
    """qwen2.5vl-7b at TP 4 x PP 2 (64 micro-batches per rank): full keeps a rank's share of the
    step's encoder activations, 64 / 8 micro-batches' worth; with recompute one micro-batch's plus
    the step's gathered features, at most none's (at vision TP 1) plus those features."""
    result = invoke("--preset", "qwen2.5vl-7b", "parallel.tensor_model_parallel_size=4",
                    "parallel.pipeline_model_parallel_size=2", "parallel.world_size=8",
                    "parallel.vision_tensor_model_parallel_size=1", "parallel.encoder_dp=full", "--dry-run")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "encoder activations" in line)
    print(row)
    sizes = dict(re.findall(r"(none|tp|full|full, recompute) ~([\d.]+) GiB", row))
    h, i, depth, seq_len, merge, out = 1280, 3420, 32, 16384, 4, 3584  # the preset's
    per_patch = depth * 2 * (4 * h + (4 * h + 3 * i))  # bf16, vision TP 1
    patches = seq_len * merge
    features = 64 * seq_len * out * 2 * 2
    expected = {"none": 2 * patches * per_patch, "tp": 2 * patches / 4 * per_patch,
                "full": 64 / 8 * patches * per_patch + features, "full, recompute": patches * per_patch + features}
    assert {mode: float(size) for mode, size in sizes.items()} == {
        mode: round(size / 1024**3, 1) for mode, size in expected.items()}
    assert "full ~" + sizes["full"] + " GiB (this run)" in row
    assert float(sizes["full, recompute"]) <= float(sizes["none"]) / 2 + features / 1024**3 + 0.1
    assert float(sizes["full"]) >= 4 * float(sizes["full, recompute"])


def test_encoder_full_recompute_without_full_is_one_line():
    assert_usage_error(invoke("--preset", "qwen2.5vl-7b", "parallel.encoder_full_recompute=true", "--dry-run"),
                       "parallel.encoder_full_recompute=true applies to parallel.encoder_dp=full")


@pytest.mark.parametrize("world_source", [
    ["parallel.world_size=8"], ["--nproc-per-node", "8"]])
def test_dry_run_7b_at_tp4_pp2(world_source):
    result = invoke("--preset", "qwen2.5vl-7b", "parallel.tensor_model_parallel_size=4",
                    "parallel.pipeline_model_parallel_size=2", *world_source, "--dry-run")
    assert result.exit_code == 0, result.output
    plan = result.stdout.split("parallel plan\n")[1]
    assert "8 processes = TP4 x PP2 x DP1" in plan
    assert "64 per rank per step" in plan
    assert "layers 0-13 (14)" in plan and "layers 14-27 (14)" in plan


def test_dry_run_output_dir_sets_logging_output_dir(tmp_path):
    import yaml

    result = invoke("--dry-run", "--output-dir", str(tmp_path / "run: 1"))
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout.split("parallel plan\n")[0])
    assert resolved["logging"]["output_dir"] == str(tmp_path / "run: 1")


def test_config_errors_exit_2_with_one_line_each():
    lines = assert_usage_error(invoke("--dry-run", "optimizer.lrr=1", "training.precision=fp16"),
                               "did you mean 'optimizer.lr'?")
    assert len(lines) == 1  # structure errors first; the choice error shows once they are fixed
    lines = assert_usage_error(invoke("--dry-run", "training.precision=fp16", "data.source=files"),
                               "training.precision", "data.paths")
    assert len(lines) == 2


def test_unknown_preset_exits_2_with_did_you_mean():
    assert_usage_error(invoke("--preset", "qwen2.5vl-7", "--dry-run"),
                       "unknown preset 'qwen2.5vl-7'; did you mean 'qwen2.5vl-7b'?")


def test_bad_override_syntax_exits_2():
    assert_usage_error(invoke("--dry-run", "lr"), "is not a key=value override")


def test_layout_error_exits_2_with_remedy():
    assert_usage_error(invoke("--preset", "qwen2.5vl-7b", "--nproc-per-node", "3", "--dry-run"),
                       "world size 3 is not a multiple of TP x PP x CP = 2 x 1 x 1 = 2")


def test_a_layout_the_model_family_refuses_exits_2_before_anything_starts(tmp_path):
    # The dry run says it; so does a real start (checked before any process is launched).
    overrides = ("--preset", "qwen3vl-tiny", "parallel.tensor_model_parallel_size=2",
                 "parallel.vision_tensor_model_parallel_size=1", "parallel.encoder_dp=full", "--nproc-per-node", "2")
    for mode in (("--dry-run",), ("--output-dir", str(tmp_path / "run"))):
        assert_usage_error(invoke(*overrides, *mode), "model.family=qwen3_vl implements none | tp")
    assert not (tmp_path / "run").exists()


def test_missing_config_file_exits_2(tmp_path):
    assert_usage_error(invoke("--dry-run", "--config", str(tmp_path / "absent.yaml")),
                       "cannot read config file")


def test_yaml_syntax_error_exits_2_with_position(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training: [\n")
    assert_usage_error(invoke("--dry-run", "--config", str(path)), f"{path}:2:1: YAML syntax error")


def test_real_run_without_launch_refuses_a_larger_world_size(monkeypatch):
    # A plain `loongforge train` is one process; a world size it cannot honour must be refused
    # (it used to train with one process and exit 0), before any training code runs.
    monkeypatch.setattr("loongforge.train.launch.run_training_worker",
                        lambda *args: pytest.fail("must not train"))
    for args in (["parallel.world_size=4"], ["--preset", "qwen2.5vl-7b"]):
        world = "4" if args[0].endswith("4") else "8"
        lines = assert_usage_error(invoke(*args), f"parallel.world_size={world} but nothing starts",
                                   f"--nproc-per-node {world}", "torchrun/srun")
        assert len(lines) == 1


def test_train_calls_runner_with_resolved_config(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("loongforge.train.launch.run_training_worker",
                        lambda cfg, resume, command_line: calls.append((cfg, resume, command_line)))
    result = invoke("training.train_steps=2", "--resume", "--output-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    ((cfg, resume, command_line),) = calls
    assert cfg.training.train_steps == 2 and resume is True
    assert isinstance(command_line, list)


def test_train_under_torchrun_does_not_spawn(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = []
    monkeypatch.setattr("loongforge.train.launch.launch_local_workers",
                        lambda *a, **k: pytest.fail("must not spawn under torchrun"))
    monkeypatch.setattr("loongforge.train.launch.run_training_worker",
                        lambda cfg, resume, command_line: calls.append(cfg))
    result = invoke("--nproc-per-node", "2", "--output-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert calls[0].parallel.world_size == 2  # taken from the launcher's WORLD_SIZE


def test_nproc_per_node_spawns_local_workers(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    launched = {}
    monkeypatch.setattr("loongforge.train.launch.launch_local_workers",
                        lambda cfg, **kwargs: launched.update(cfg=cfg, **kwargs))
    result = invoke("--nproc-per-node", "2", "--output-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert launched["nproc_per_node"] == 2 and launched["cfg"].parallel.world_size == 2


def _plan_line(plan: str, label: str) -> str:
    return next(line for line in plan.splitlines() if line.strip().startswith(label))


def test_dry_run_counts_loras_adapters_and_frozen_weights_without_optimizer_state():
    """qwen2.5vl-7b (TP 2 x DP 4, bf16, distributed optimizer: 2 + 4 + 12 / 4 = 9 bytes per trained
    parameter, 2 per frozen one). LoRA rank 8 on every language linear has PEFT's count for the
    Qwen2-7B decoder: 28 layers x 8 x (q 3584+3584, k and v 3584+512, o 3584+3584, gate and up
    3584+18944, down 18944+3584) = 20,185,088. A frozen vision tower keeps its weights only."""
    from loongforge.config.loader import load_run_config
    from loongforge.models.registry import get_family

    def plan(*overrides: str) -> str:
        return invoke("--preset", "qwen2.5vl-7b", "--dry-run", *overrides).stdout.split("parallel plan\n")[1]

    def gib(line: str) -> float:
        return float(line.split("~")[1].split(" GiB")[0])

    full, lora, frozen = plan(), plan("lora.rank=8"), plan("training.freeze_vision=true")
    assert 28 * 8 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 2 * (3584 + 18944) + 18944 + 3584) == 20_185_088
    assert "20.19M LoRA adapter parameters (0.24% of 8.29B): rank 8, alpha 16 on language" in _plan_line(lora, "trainable")
    full_gib, lora_gib = gib(_plan_line(full, "memory per rank")), gib(_plan_line(lora, "memory per rank"))
    print(f"qwen2.5vl-7b per rank: full {full_gib} GiB, LoRA {lora_gib} GiB")
    assert f"full fine-tuning at this layout: ~{full_gib:.1f} GiB" in _plan_line(lora, "memory per rank")
    per_rank = 8_292_166_656 / 2  # one stage, TP 2
    assert abs(lora_gib - (per_rank * 2 + 20_185_088 / 2 * 9) / 1024**3) < 0.3  # adapters: about half per rank
    vision = get_family("qwen2_5_vl").count_parameters(load_run_config("qwen2.5vl-7b").model)["vision_model"]
    assert gib(_plan_line(frozen, "memory per rank")) == pytest.approx(full_gib - vision / 2 * (9 - 2) / 1024**3, abs=0.06)
    assert "(vision tower frozen)" in _plan_line(frozen, "trainable")
    # The alignment stage: the language model frozen too, its weights held at 2 bytes a parameter.
    aligned = plan("training.freeze_vision=true", "training.freeze_language=true")
    counts = get_family("qwen2_5_vl").count_parameters(load_run_config("qwen2.5vl-7b").model)
    projector = counts["projector"]
    assert f"{projector / 1e6:.2f}M of 8.29B (vision tower and language model frozen)" in _plan_line(aligned, "trainable")
    aligned_gib = gib(_plan_line(aligned, "memory per rank"))
    print(f"qwen2.5vl-7b per rank, projector alone trained: {aligned_gib} GiB")
    assert aligned_gib < gib(_plan_line(frozen, "memory per rank")) / 3


# --------------------------------------------------------------------------- context parallelism

GIB = 1024**3
QWEN2_5_VL_7B_PARAMS = 8_292_166_656


def _context_table(stdout: str) -> dict[int, list[str]]:
    """The CP table's rows by CP: [layout, tokens/rank, activations GiB, total GiB, fits]."""
    lines = stdout.split("context parallel at seq_len")[1].splitlines()[2:]
    rows = {}
    for line in lines:
        match = re.match(r"\s+(\d+)  (TP\S+(?: x \S+)*(?:, world \d+)?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)  (.+)$", line)
        if match is None:
            break
        rows[int(match[1])] = [match[2], match[3], match[4], match[5], match[6]]
    return rows


def _qwen2_5_vl_7b_memory(cp: int, seq_len: int, world: int = 8, recompute: bool = False) -> tuple[int, float, float]:
    """qwen2.5vl-7b per rank at CP ``cp``, by the documented formulas (TP 2 + SP, vision TP 2, bf16,
    Adam on the distributed optimizer, PP 1, encoder_dp none, encoder_cp on): (DP, activations, total).
    With recompute a layer (block) keeps its input, and one layer's (block's) values live at a time."""
    dp = world // (2 * cp)
    states = QWEN2_5_VL_7B_PARAMS / 2 * (2 + 4 + 12 / (dp * cp))  # master + moments over DP x CP
    tokens = seq_len / cp
    h, q, kv, ffn = 3584, 3584, 4 * 128, 18944
    # Under CP attention also keeps the keys and values its two chunks see: CP + 1/2 times its own.
    keys_kept = 2 * kv * (1 + (cp + 0.5 if cp > 1 else 0))
    layer = 2 * (4 * h / 2 + (2 * q + keys_kept + 3 * ffn) / 2)  # bytes per token, SP splits the h's
    decoder = tokens * (28 * 2 * h / 2 + layer if recompute else 28 * layer)
    vision_h, vision_i = 1280, 3420
    block = 2 * (4 * vision_h + (4 * vision_h + 3 * vision_i) / 2)
    encoder = seq_len * 4 / cp * (32 * 2 * vision_h + block if recompute else 32 * block)
    head = tokens * 152064 / 2 * (2 + 4)
    activations = decoder + max(encoder, head)
    return dp, activations, states + activations


def test_dry_run_context_parallel_table_numbers():
    """qwen2.5vl-7b at its 16384-token rows, CP 1-16, each number from the formulas by hand; CP 8 and
    16 need more than the preset's 8 processes (TP 2 x CP 8 = 16)."""
    result = invoke("--preset", "qwen2.5vl-7b", "--dry-run")
    assert result.exit_code == 0, result.output
    table = _context_table(result.stdout)
    print("\ncontext parallel" + result.stdout.split("\ncontext parallel")[1])
    assert sorted(table) == [1, 2, 4, 8, 16]
    for cp, (layout, tokens, activations, total, fits) in table.items():
        world = max(8, 2 * cp)
        dp, expected_activations, expected_total = _qwen2_5_vl_7b_memory(cp, 16384, world)
        context = f" x CP{cp}" if cp > 1 else ""
        assert layout == f"TP2{context} x PP1 x DP{dp}" + (f", world {world}" if world != 8 else ""), layout
        assert int(tokens) == 16384 // cp
        assert float(activations) == round(expected_activations / GIB, 1), cp
        assert float(total) == round(expected_total / GIB, 1), cp
        assert fits == ("yes" if expected_total <= 0.9 * 80 * GIB else "no"), (cp, fits)
    assert [table[cp][4] for cp in (1, 2, 4)] == ["no", "no", "yes"]  # worst-case rows: every token an image token


def test_dry_run_fit_seq_len_picks_the_smallest_cp_that_fits_80_gib():
    """qwen2.5vl-7b at 131072 tokens per row: CP 8 (~117 GiB per rank) does not fit 90% of 80 GiB,
    CP 16 (~72 GiB) does and needs TP 2 x CP 16 = 32 processes; with recompute CP 4 fits the 8."""
    result = invoke("--preset", "qwen2.5vl-7b", "--dry-run", "--fit-seq-len", "131072")
    assert result.exit_code == 0, result.output
    report = "context parallel" + result.stdout.split("\ncontext parallel")[1]
    print("\n" + report)
    table = _context_table(result.stdout)
    for cp in (8, 16):
        _, _, total = _qwen2_5_vl_7b_memory(cp, 131072, world=2 * cp)
        assert float(table[cp][3]) == round(total / GIB, 1)
    assert table[8][4] == "no" and table[16][4] == "yes"
    fit = report.split("\nfit: ")[1].splitlines()
    cp16 = _qwen2_5_vl_7b_memory(16, 131072, world=32)[2]
    assert fit[0].startswith("CP16 is the smallest context-parallel size that fits seq_len 131072 in 72.0 GiB "
                             f"per rank (~{cp16 / GIB:.1f} GiB); it needs 32 processes, the run has 8")
    assert fit[1].strip() == "parallel.context_parallel_size=16 data.seq_len=131072 parallel.world_size=32"
    _, _, recomputed = _qwen2_5_vl_7b_memory(4, 131072, recompute=True)
    assert f"training.recompute_activations=true (every layer's forward twice): CP4 fits " \
           f"(~{recomputed / GIB:.1f} GiB)" in fit[2]
    assert _qwen2_5_vl_7b_memory(2, 131072, recompute=True)[2] > 0.9 * 80 * GIB  # CP 2 does not
    assert "encoder_cp  CP16: predicted step time per rank" in report and "% less)" in report


def test_dry_run_fit_seq_len_without_a_fit_is_one_line_and_needs_dry_run():
    result = invoke("--preset", "qwen2.5vl-7b", "--dry-run", "--fit-seq-len", "1048576", "--gpu-memory-gib", "24",
                    "training.recompute_activations=true")
    assert result.exit_code == 0, result.output
    fit = [line for line in result.stdout.splitlines() if line.startswith("fit: ")]
    assert len(fit) == 1 and fit[0].startswith("fit: no CP size up to 16 fits seq_len 1048576 in 21.6 GiB per rank")
    # 131000 tokens fit at CP 16 but split into 2 x 16 chunks per sample only at a multiple of 32.
    blocked = invoke("--preset", "qwen2.5vl-7b", "--dry-run", "--fit-seq-len", "131000").stdout
    assert "fit: CP16 would fit seq_len 131000 in 72.0 GiB per rank (~71.6 GiB), but data.seq_len=131000 must be " \
           "a multiple of 32" in blocked
    assert_usage_error(invoke("--preset", "qwen2.5vl-7b", "--fit-seq-len", "131072"),
                       "--fit-seq-len 131072 plans a layout and starts nothing; add --dry-run")


def test_dry_run_at_cp2_states_the_layout_and_shards_the_optimizer_over_dp_x_cp():
    """CP 2 on the preset's 8 processes: DP 2, and the distributed optimizer shards master weights and
    moments over DP x CP = 4 ranks, as megatron-core does: 2 + 4 + 12 / 4 = 9 bytes per parameter."""
    plan = invoke("--preset", "qwen2.5vl-7b", "parallel.context_parallel_size=2", "--dry-run").stdout
    assert "8 processes = TP2 x CP2 x PP1 x DP2" in plan
    assert "data parallel        2 = 8 / (TP2 x PP1 x CP2)" in plan
    assert "each 16384-token row split over 2 ranks, 8192 tokens per rank (every sample padded to a multiple of 4)" in plan
    memory = _plan_line(plan, "memory per rank")
    assert "sharded over DP2 x CP2; 9.00 bytes/param" in memory  # the default at DP x CP > 1 (no setting)
    plain = invoke("--preset", "qwen2.5vl-7b", "parallel.context_parallel_size=2",
                   "parallel.use_distributed_optimizer=false", "--dry-run").stdout
    assert "Adam moments; 18.00 bytes/param" in _plan_line(plain, "memory per rank")  # 2 + 4 + 12 whole
    assert f"~{QWEN2_5_VL_7B_PARAMS / 2 * 9 / GIB:.1f} GiB" in memory
    off = invoke("--preset", "qwen2.5vl-7b", "parallel.context_parallel_size=2", "parallel.encoder_cp=false",
                 "--dry-run").stdout
    assert "every CP rank encodes all of the row's images and videos (parallel.encoder_cp=false)" in off
    # encoder_cp halves the encoder's activations per rank in encoder_dp=none at CP 2.
    on_none, off_none = (float(re.search(r"none ~([\d.]+) GiB", text)[1]) for text in (plan, off))
    assert on_none == pytest.approx(off_none / 2, abs=0.1)


def test_dry_run_qwen3_next_80b_fits_80gb_gpus_and_its_128k_rows_at_cp4():
    """Qwen3-Next-80B-A3B: 48 hybrid layers at TP 2 (SP), EP 32 (16 of every layer's 512 experts a rank), full
    recompute; this rank's parameters counted here (the non-expert part halved by TP, the experts / 32); its 32k rows
    fit at CP 1, and 128k-token rows need context parallelism: CP 4."""
    from loongforge.config.loader import load_run_config
    from loongforge.models.decoder.params import expert_parameters

    out = invoke("--preset", "qwen3-next-80b-a3b", "--dry-run").stdout
    plan = out.split("parallel plan\n")[1]
    assert "64 processes = TP2 x PP1 x DP32" in plan and "EP32 x expert TP1 x expert DP2" in plan
    assert "79.67B total (79,674,391,296), 3.87B active per token" in plan
    lang = load_run_config("qwen3-next-80b-a3b").model.language
    experts = lang.num_layers * expert_parameters(lang)
    per_rank = (79_674_391_296 - experts) / 2 + experts / 32
    assert f"layers 0-47 (48) + embeddings + LM head: {per_rank / 1e9:.2f}B params per rank" in plan

    def cp_totals(text: str) -> dict[int, tuple[float, str]]:
        table = text.split("CP  layout")[1].splitlines()[1:]
        return {int(line.split()[0]): (float(line.split()[-2]), line.split()[-1]) for line in table
                if line.strip()[:1].isdigit()}

    at_32k = cp_totals(out)
    long_rows = cp_totals(invoke("--preset", "qwen3-next-80b-a3b", "--dry-run", "data.seq_len=131072").stdout)
    print(f"\nqwen3-next-80b-a3b: {per_rank / 1e9:.2f}B params per rank; 32k rows at CP 1 {at_32k[1][0]} GiB; 128k rows "
          f"{ {cp: total for cp, (total, _) in long_rows.items()} } GiB by CP")
    assert at_32k[1][1] == "yes" and at_32k[1][0] <= 72.0
    assert [long_rows[cp][1] for cp in (1, 2, 4)] == ["no", "no", "yes"]
