"""Shape and cross-field validation messages."""

from __future__ import annotations

import pytest

from loongforge.config.errors import ConfigError
from loongforge.config.language_parts import MOVED_TO_MOE
from loongforge.config.loader import load_resolved_config, load_run_config, to_dict
from loongforge.config.validate import build_run_config, check_run_config
from loongforge.config.yaml_io import dump_yaml_tree


def errors_for(*overrides, preset="qwen2.5vl-tiny", world_size=None):
    with pytest.raises(ConfigError) as info:
        load_run_config(preset, overrides=list(overrides), world_size=world_size)
    return info.value.messages


def test_unknown_key_gives_full_path_and_did_you_mean():
    (message,) = errors_for("model.language.num_layer=3")
    assert message == ("unknown key 'model.language.num_layer'; "
                       "did you mean 'model.language.num_layers'?")


def test_key_in_wrong_section_suggests_its_real_section():
    (message,) = errors_for("training.lr=1e-4")
    assert "did you mean 'optimizer.lr'?" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    (message,) = errors_for("schedule.zzzzzz=1")
    assert "unknown key 'schedule.zzzzzz'" in message
    assert "warmup_steps, decay_style" in message


def test_unknown_section_is_reported_once():
    (message,) = errors_for("modle.language.num_layers=3")
    assert message == "unknown key 'modle'; did you mean 'model'?"


def test_type_error_names_key_and_expected_type():
    (message,) = errors_for("model.language.num_layers=four")
    assert message.startswith(
        "model.language.num_layers: expected an integer, got 'four' (a string)")


@pytest.mark.parametrize("override, expected", [
    ("optimizer.lr=fast", "optimizer.lr: expected a number"),
    ("training.freeze_vision=3", "training.freeze_vision: expected true or false"),
    ("model.language.mrope_section=[4, x, 6]",
     "model.language.mrope_section: expected a list of integers"),
    ("parallel.vision_tensor_model_parallel_size=two",
     "parallel.vision_tensor_model_parallel_size: expected an integer or null"),
    ("model.vision=5", "model.vision: expected a section of keys"),
    ("training.train_steps=1.5", "training.train_steps: expected an integer"),
    ("training.train_steps=true", "training.train_steps: expected an integer"),
])
def test_type_errors(override, expected):
    (message,) = errors_for(override)
    assert message.startswith(expected)


def test_floats_accept_ints_and_optional_accepts_null():
    cfg = build_run_config({"optimizer": {"lr": 1}, "checkpoint": {"dir": None},
                            "parallel": {"vision_tensor_model_parallel_size": 1}})
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.parallel.vision_tensor_model_parallel_size == 1


def test_multiple_structure_errors_reported_at_once():
    messages = errors_for("training.train_stepz=3", "optimizer.lr=x", "data.seq_lenn=5")
    assert len(messages) == 3
    assert any("training.train_stepz" in m for m in messages)
    assert any(m.startswith("optimizer.lr: expected a number") for m in messages)
    assert any("data.seq_lenn" in m for m in messages)


def test_multiple_rule_errors_reported_at_once():
    messages = errors_for("training.precision=bf32", "data.source=files",
                          "model.language.mrope_section=[4, 6, 8]")
    assert len(messages) == 3
    assert any("training.precision='bf32' is not one of bf16 | fp32; did you mean" in m
               for m in messages)
    assert any("data.source=files needs data.paths" in m for m in messages)
    assert any("mrope_section" in m for m in messages)


@pytest.mark.parametrize("path, bad", [
    ("model.layer_backend", "flash2"), ("training.precision", "fp16"),
    ("schedule.decay_style", "linear"), ("data.source", "web"), ("optimizer.name", "adamw"),
    ("training.device", "gpu"), ("data.record_kind", "pretrain"),
])
def test_choices(path, bad):
    (message,) = errors_for(f"{path}={bad}")
    assert message.startswith(f"{path}='{bad}' is not one of")


def test_tp_not_dividing_heads_says_what_to_change():
    messages = errors_for("parallel.tensor_model_parallel_size=3", preset="qwen2.5vl-7b",
                          world_size=3)
    heads = [m for m in messages if "num_attention_heads=28" in m]
    assert heads == ["parallel.tensor_model_parallel_size=3 does not divide "
                     "model.language.num_attention_heads=28; set it to one of 1, 2, 4 "
                     "(sizes dividing the heads, KV heads and FFN size)."]
    assert any("num_query_groups (KV heads)=4" in m for m in messages)


def test_tp_not_dividing_kv_heads():
    messages = errors_for("parallel.tensor_model_parallel_size=4", preset="qwen2.5vl-3b")
    assert any("model.language.num_query_groups (KV heads)=2" in m for m in messages)


def test_vision_tp_inherited_from_language_tp_must_divide_vision_mlp():
    # The 32B language model splits over TP8; a 3420-wide vision MLP (3B/7B tower) does not.
    messages = errors_for("model.vision.intermediate_size=3420", preset="qwen2.5vl-32b")
    assert messages == ["vision tensor parallel size 8 (inherited from "
                        "parallel.tensor_model_parallel_size) does not divide "
                        "model.vision.intermediate_size=3420; set "
                        "parallel.vision_tensor_model_parallel_size to one of 1, 2, 4."]
    # The remedy works:
    cfg = load_run_config("qwen2.5vl-32b", overrides=[
        "model.vision.intermediate_size=3420", "parallel.vision_tensor_model_parallel_size=4"])
    assert cfg.parallel.vision_tensor_model_parallel_size == 4


def test_bad_language_tp_is_not_repeated_for_inherited_vision_tp():
    messages = errors_for("parallel.tensor_model_parallel_size=8", preset="qwen2.5vl-7b")
    assert messages and not any("vision" in m for m in messages)


def test_vision_tp_must_divide_language_tp():
    messages = errors_for("parallel.vision_tensor_model_parallel_size=4", preset="qwen2.5vl-7b")
    assert any("does not divide parallel.tensor_model_parallel_size=2" in m for m in messages)


def test_encoder_dp_choices_name_the_accepted_modes():
    (message,) = errors_for("parallel.encoder_dp=everything")
    assert message == ("parallel.encoder_dp='everything' is not one of none | tp | full; set "
                       "parallel.encoder_dp to one of those.")
    (message,) = errors_for("parallel.encoder_dp=tpp")
    assert "did you mean 'tp'?" in message


def test_encoder_dp_needs_vision_tp_1_and_names_both_keys():
    (message,) = errors_for("parallel.encoder_dp=tp", "parallel.tensor_model_parallel_size=2",
                            world_size=2)
    assert message == ("parallel.encoder_dp=tp needs parallel.vision_tensor_model_parallel_size=1, "
                       "got 2 (inherited from parallel.tensor_model_parallel_size); set "
                       "parallel.vision_tensor_model_parallel_size=1 or parallel.encoder_dp=none.")
    (message,) = errors_for("parallel.encoder_dp=tp", "parallel.tensor_model_parallel_size=2",
                            "parallel.vision_tensor_model_parallel_size=2", world_size=2)
    assert message.startswith("parallel.encoder_dp=tp needs parallel.vision_tensor_model_parallel_size=1, got 2;")
    for overrides in ([], ["parallel.tensor_model_parallel_size=2",
                           "parallel.vision_tensor_model_parallel_size=1"]):
        cfg = load_run_config("qwen2.5vl-tiny", overrides=["parallel.encoder_dp=tp", *overrides],
                              world_size=2)
        assert cfg.parallel.encoder_dp == "tp"


def test_encoder_dp_full_needs_vision_tp_1_and_names_both_keys():
    (message,) = errors_for("parallel.encoder_dp=full", "parallel.tensor_model_parallel_size=2",
                            "parallel.pipeline_model_parallel_size=2", world_size=4)
    assert message == ("parallel.encoder_dp=full needs parallel.vision_tensor_model_parallel_size=1, "
                       "got 2 (inherited from parallel.tensor_model_parallel_size); set "
                       "parallel.vision_tensor_model_parallel_size=1 or parallel.encoder_dp=none.")
    cfg = load_run_config("qwen2.5vl-tiny", overrides=[
        "parallel.encoder_dp=full", "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2", "parallel.vision_tensor_model_parallel_size=1"],
        world_size=4)
    assert cfg.parallel.encoder_dp == "full"


def test_world_size_must_be_multiple_of_tp_times_pp():
    messages = errors_for("parallel.tensor_model_parallel_size=4",
                          "parallel.pipeline_model_parallel_size=2", preset="qwen2.5vl-7b",
                          world_size=12)
    assert messages == ["world size 12 is not a multiple of TP x PP x CP = 4 x 2 x 1 = 8; launch a "
                        "multiple of 8 processes (--nproc-per-node or parallel.world_size) or "
                        "lower the TP/PP/CP sizes."]


def test_context_parallelism_takes_its_share_of_the_world_and_whole_chunks():
    messages = errors_for("parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
                          world_size=6)
    assert messages == ["world size 6 is not a multiple of TP x PP x CP = 2 x 1 x 2 = 4; launch a multiple of "
                        "4 processes (--nproc-per-node or parallel.world_size) or lower the TP/PP/CP sizes."]
    (message,) = errors_for("parallel.context_parallel_size=2", "data.seq_len=1022", world_size=2)
    assert message == "data.seq_len=1022 must be a multiple of 4 (samples padded to a multiple of 4)."
    (message,) = errors_for("parallel.context_parallel_size=2", "data.sample_multiple=6", world_size=2)
    assert message == ("data.sample_multiple=6 must be a positive multiple of 4 (2 x parallel.context_parallel_size); "
                       "set it to 4 or leave it null.")
    (message,) = errors_for("parallel.context_parallel_size=2", "parallel.context_parallel_comm=p2p",
                            "model.layer_backend=sdpa", world_size=2)
    assert message.startswith("parallel.context_parallel_comm=p2p is Transformer Engine's; the sdpa layer backend")


def test_global_batch_divisible_by_data_parallel():
    (message,) = errors_for("training.global_batch_size=5", world_size=2)
    assert "training.global_batch_size=5 is not divisible by the data-parallel size 2" in message


def test_pipeline_must_divide_layers():
    (message,) = errors_for("parallel.pipeline_model_parallel_size=3", world_size=3,
                            preset="qwen2.5vl-tiny")
    assert message.startswith("parallel.pipeline_model_parallel_size=3 does not divide "
                              "model.language.num_layers=4; set it to one of 1, 2, 4")


def test_deepstack_layers_must_all_be_on_the_first_pipeline_stage():
    # qwen3vl-tiny: 4 decoder layers, DeepStack into layers 0 and 1.
    (message,) = errors_for("parallel.pipeline_model_parallel_size=4", world_size=4, preset="qwen3vl-tiny")
    assert message == ("the first pipeline stage holds 1 language layer, but DeepStack "
                       "(model.vision.deepstack_layers) adds vision features after the first 2, which must all "
                       "be there; give it more (parallel.pipeline_layout) or lower the pipeline sizes.")
    load_run_config("qwen3vl-tiny", overrides=["parallel.pipeline_model_parallel_size=2"], world_size=2)


def test_deepstack_needs_as_many_decoder_layers_as_entries():
    (message,) = errors_for("model.language.num_layers=1", preset="qwen3vl-tiny")
    assert message.startswith("model.vision.deepstack_layers has 2 entries, added after the first 2 "
                              "decoder layers, but model.language.num_layers=1;")


def test_mrope_sections_must_sum_to_half_head_dim():
    (message,) = errors_for("model.language.mrope_section=[16,24,24]")
    assert message.startswith("model.language.mrope_section=[16, 24, 24] sums to 64 but must "
                              "sum to head_dim/2 = 16")


def test_projector_width_must_match_language_hidden():
    (message,) = errors_for("model.projector.out_hidden_size=64")
    assert "set model.projector.out_hidden_size=128" in message


def test_data_sources_need_their_inputs():
    assert "data.source=files needs data.paths" in errors_for("data.source=files")[0]
    assert "data.source=packed needs data.packed" in errors_for("data.source=packed")[0]
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["data.source=packed", "data.packed=/tmp/p"])
    assert cfg.data.packed == "/tmp/p"


def test_accept_changed_files_applies_to_data_files_and_is_a_bool():
    (message,) = errors_for("data.accept_changed_files=true")  # the preset reads synthetic samples
    assert message == ("data.accept_changed_files=true resumes past changed data.paths files; it does not apply to "
                       "data.source=synthetic; set data.source=files or data.accept_changed_files=false.")
    (message,) = errors_for("data.accept_changed_files=maybe")
    assert "data.accept_changed_files" in message
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["data.source=files", "data.paths=[a.jsonl]",
                                                       "data.accept_changed_files=true"])
    assert cfg.data.accept_changed_files is True and load_run_config("qwen2.5vl-tiny").data.accept_changed_files is False


def test_nonpositive_sizes_are_reported_without_crashing():
    messages = errors_for("parallel.tensor_model_parallel_size=0",
                          "model.language.num_attention_heads=0")
    assert len(messages) == 2
    assert all("must be at least 1" in m for m in messages)


def test_world_size_argument_overrides_config_value():
    cfg = load_run_config("qwen2.5vl-tiny")
    assert check_run_config(cfg, world_size=3) == [
        "training.global_batch_size=4 is not divisible by the data-parallel size 3 (world 3 / "
        "(TP 1 x PP 1 x CP 1)); use a multiple of 3."]


def test_data_read_choices_and_packed_sharded():
    (message,) = errors_for("data.read=shard")
    assert "data.read='shard'" in message and "did you mean 'sharded'" in message
    messages = errors_for("data.source=packed", "data.packed=/tmp/x", "data.read=sharded")
    assert any("data.read=sharded does not apply to data.source=packed" in m for m in messages)


def test_moe_fields_are_checked_with_the_fix():
    load_run_config("qwen3-moe-tiny")  # valid as shipped
    (topk,) = errors_for("model.language.moe.router_topk=9", preset="qwen3-moe-tiny")
    assert topk == ("model.language.moe.router_topk=9 must be between 1 and model.language.moe.num_experts=8.")
    (width,) = errors_for("model.language.moe.ffn_hidden_size=null", preset="qwen3-moe-tiny")
    assert width == "model.language.moe.ffn_hidden_size=None must be at least 1 (each expert's MLP width)."
    (none,) = errors_for("model.language.moe.num_experts=0", preset="qwen3-moe-tiny")
    assert none == "model.language.moe.num_experts=0 must be at least 1 (a dense model sets model.language.moe: null)."
    (coeff,) = errors_for("model.language.moe.aux_loss_coeff=-1", preset="qwen3-moe-tiny")
    assert "must not be negative" in coeff
    (dense,) = errors_for("model.language.moe.first_dense_layers=99", preset="qwen3-moe-tiny")
    assert dense.startswith("model.language.moe.first_dense_layers=99 must lie in 0..")
    (experts,) = errors_for("model.language.moe.experts=fast", preset="qwen3-moe-tiny")
    assert experts == "model.language.moe.experts='fast' must be one of auto, grouped, sequential."
    assert load_run_config("qwen3-moe-tiny", overrides=["model.language.moe=null"]).model.language.moe is None


def test_modality_isolated_experts_take_their_balance_loss_under_plain_pipelines_only():
    """ERNIE-4.5-VL's balance loss chains the routers' counts along a 1F1B pipeline (models.decoder.modality_balance):
    its coefficient loads at TP 2 x PP 2 and is refused with virtual stages, one line naming both keys."""
    layout = ["model.language.moe.aux_loss_coeff=0.01", "model.language.num_layers=4",
              "parallel.pipeline_model_parallel_size=2"]
    cfg = load_run_config("ernie4.5vl-tiny", overrides=[*layout, "parallel.tensor_model_parallel_size=2",
                                                        "parallel.sequence_parallel=true"], world_size=4)
    assert cfg.model.language.moe.aux_loss_coeff == 0.01
    (virtual,) = errors_for(*layout, "parallel.virtual_pipeline_model_parallel_size=2", preset="ernie4.5vl-tiny",
                            world_size=2)
    assert virtual.startswith("model.language.moe.aux_loss_coeff=0.01 with vision_ffn_hidden_size")
    assert "parallel.virtual_pipeline_model_parallel_size" in virtual and "aux_loss_coeff: 0" in virtual


def test_the_vision_sections_check_themselves():
    (size,) = errors_for("model.vision.window.size=100")
    assert size == ("model.vision.window.size=100 px must be a multiple of patch_size x spatial_merge_size = 28 px so "
                    "windows hold whole merged tokens.")
    (blocks,) = errors_for("model.vision.window.fullatt_block_indexes=[5]")
    assert blocks.startswith("model.vision.window.fullatt_block_indexes has [5] outside the 2 vision blocks")
    (pinpoints,) = errors_for("model.vision.anyres.pinpoints=[[56,60]]", preset="llava-onevision-tiny")
    assert pinpoints == ("model.vision.anyres.pinpoints has [[56, 60]]: each is a (height, width) pair of multiples "
                         "of model.vision.image_size=56.")


def test_flat_vision_keys_of_older_configs_move_into_their_sections_with_one_line_each(tmp_path, capsys):
    """A config.yaml saved before ``model.vision.window`` / ``anyres`` loads as the same model; a null window_size
    or empty anyres_pinpoints is a null section."""
    old = tmp_path / "config.yaml"
    old.write_text("model:\n  vision:\n    window_size: 112\n    fullatt_block_indexes: [1]\n"
                   "    anyres_pinpoints: []\n    anyres_max_crops: 9\n")
    assert load_run_config("qwen2.5vl-tiny", config_file=old).model == load_run_config("qwen2.5vl-tiny").model
    lines = capsys.readouterr().err.splitlines()
    print(lines)
    assert lines[:2] == ["model.vision.window_size is now model.vision.window.size; read so.",
                         "model.vision.fullatt_block_indexes is now model.vision.window.fullatt_block_indexes; read so."]
    assert len(lines) == 4
    old.write_text("model:\n  vision:\n    window_size: null\n    fullatt_block_indexes: []\n"
                   "    anyres_pinpoints: [[56, 56], [56, 112]]\n    anyres_max_crops: 4\n")
    llava = load_run_config("llava-onevision-tiny", config_file=old).model.vision
    assert llava.window is None and llava.anyres.pinpoints == [[56, 56], [56, 112]] and llava.anyres.max_crops == 4


def test_flat_expert_keys_of_older_configs_move_into_the_moe_section_with_one_line_each(tmp_path, capsys):
    """A config.yaml saved before ``model.language.moe`` (its expert keys flat under model.language) loads as
    the same model, each moved key told in one line naming its new key; a dense one's num_experts: 0 is
    ``moe: null``."""
    shipped = load_run_config("qwen3-moe-tiny")
    old = tmp_path / "config.yaml"
    old.write_text("model:\n  language:\n    num_experts: 8\n    moe_ffn_hidden_size: 64\n"
                   "    moe_router_topk: 2\n    moe_aux_loss_coeff: 0.001\n")
    moved = load_run_config("qwen3-moe-tiny", config_file=old)
    assert moved.model.language == shipped.model.language
    lines = capsys.readouterr().err.splitlines()
    print(lines)
    assert lines == ["model.language.num_experts is now model.language.moe.num_experts; read so.",
                     "model.language.moe_ffn_hidden_size is now model.language.moe.ffn_hidden_size; read so.",
                     "model.language.moe_router_topk is now model.language.moe.router_topk; read so.",
                     "model.language.moe_aux_loss_coeff is now model.language.moe.aux_loss_coeff; read so."]
    dense = load_run_config("qwen3-moe-tiny", overrides=["model.language.num_experts=0",
                                                         "model.language.moe_router_topk=2"])
    assert dense.model.language.moe is None
    assert capsys.readouterr().err.splitlines() == [
        "model.language.num_experts=0 (with 1 other flat expert keys) is now model.language.moe: null (a dense "
        "model); read so."]



def test_tp_must_divide_the_expert_width():
    messages = errors_for("parallel.tensor_model_parallel_size=2", "parallel.world_size=2",
                          "model.language.moe.ffn_hidden_size=33", preset="qwen3-moe-tiny")
    assert any("does not divide model.language.moe.ffn_hidden_size=33" in m for m in messages), messages
    load_run_config("qwen3-moe-tiny", overrides=["parallel.tensor_model_parallel_size=2", "parallel.world_size=2",
                                                 "parallel.sequence_parallel=true"])


def test_moe_under_tensor_parallelism_needs_sequence_parallelism():
    (message,) = errors_for("parallel.tensor_model_parallel_size=2", "parallel.world_size=2", preset="qwen3-moe-tiny")
    assert message == ("model.language.moe.num_experts=8 with parallel.tensor_model_parallel_size=2 needs "
                       "parallel.sequence_parallel=true (megatron-core trains MoE layers under TP only with "
                       "sequence parallelism); set it.")


def test_fp8_settings_are_checked_with_the_fix(tmp_path):
    load_run_config("qwen2.5vl-7b", overrides=["training.fp8=on"])  # "on" is a word, not YAML 1.1's true
    (choice,) = errors_for("training.fp8=fast", preset="qwen2.5vl-7b")
    assert choice.startswith("training.fp8='fast' is not one of off | auto | on")
    (precision,) = errors_for("training.fp8=auto")  # the tiny preset trains in fp32
    assert precision == ("training.fp8=auto needs training.precision=bf16 (FP8 GEMMs replace bf16 ones); "
                         "set training.precision=bf16 or training.fp8=off.")
    (cpu,) = errors_for("training.fp8=on", "training.device=cpu", preset="qwen2.5vl-7b")
    assert cpu.startswith("training.fp8=on needs a CUDA GPU with FP8 GEMMs (compute capability 8.9+)")
    (orphan,) = errors_for(f"fp8.policy={tmp_path}/p.json", preset="qwen2.5vl-7b")
    assert orphan.endswith("is read only with training.fp8=auto (it is off); set training.fp8=auto or fp8.policy: null.")
    (missing,) = errors_for("training.fp8=auto", f"fp8.policy={tmp_path}/p.json", preset="qwen2.5vl-7b")
    assert missing == f"fp8.policy={tmp_path}/p.json is not a file; pass the policy `loongforge bench gemm` wrote."


def test_yaml_booleans_are_true_and_false_only():
    (message,) = errors_for("balance.enabled=yes")
    assert message == "balance.enabled: expected true or false, got 'yes' (a string); the default is false."
    assert load_run_config("qwen2.5vl-tiny", overrides=["balance.enabled=True"]).balance.enabled is True


def test_values_reference_other_keys(tmp_path):
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["logging.output_dir=runs/${preset}/${training.precision}",
                                                       "checkpoint.dir=${logging.output_dir}/ckpt",
                                                       "data.synthetic_num_samples=${training.global_batch_size}"])
    assert cfg.logging.output_dir == "runs/qwen2.5vl-tiny/fp32"
    assert cfg.checkpoint.dir == "runs/qwen2.5vl-tiny/fp32/ckpt"
    assert cfg.data.synthetic_num_samples == cfg.training.global_batch_size == 4  # a whole reference keeps the type
    # A key no layer sets resolves to its schema default (OmegaConf's structured config of RunConfig).
    defaults = load_run_config("qwen2.5vl-tiny", overrides=["logging.output_dir=runs/w${data.shuffle_window}",
                                                            "training.seed=${data.shuffle_window}"])
    assert defaults.logging.output_dir == "runs/w4096" and defaults.training.seed == 4096
    literal = load_run_config("qwen2.5vl-tiny", overrides=[r"data.system_prompt=costs \${price}"])
    assert literal.data.system_prompt == "costs ${price}"


def test_every_unresolvable_reference_is_one_line_with_its_file_and_the_fix(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("logging:\n  output_dir: runs/${presets}\ncheckpoint:\n  dir: ${logging.ouput_dir}/ckpt\n")
    with pytest.raises(ConfigError) as info:
        load_run_config("qwen2.5vl-tiny", config_file=config)
    assert sorted(info.value.messages, key=lambda m: m.split(": ")[0]) == [
        f"{config}:2: logging.output_dir='runs/${{presets}}': the reference names no key of the config "
        f"(unknown key 'presets'; did you mean 'preset'?)",
        f"{config}:4: checkpoint.dir='${{logging.ouput_dir}}/ckpt': the reference names no key of the config "
        f"(unknown key 'logging.ouput_dir'; did you mean 'logging.output_dir'?)"]


def test_lora_settings_are_checked_with_the_fix():
    assert load_run_config("qwen2.5vl-tiny", overrides=["lora.rank=8"]).lora.targets == ["language"]
    (negative,) = errors_for("lora.rank=-1")
    assert negative == "lora.rank=-1 must not be negative (0: no adapters; 8-64 is usual)."
    (target,) = errors_for("lora.rank=8", "lora.targets=[language,vison]")
    assert target == ("lora.targets=['language', 'vison'] must be a non-empty list from language | vision | "
                      "projector; remove vison.")
    (empty,) = errors_for("lora.rank=8", "lora.modules=[]")
    assert empty.endswith("must be a non-empty list from qkv | proj | fc1 | fc2; name at least one.")
    alpha, dropout = errors_for("lora.rank=8", "lora.alpha=0", "lora.dropout=1.5")
    assert alpha.startswith("lora.alpha=0.0 must be positive") and dropout.startswith("lora.dropout=1.5 must be in")
    (dense,) = errors_for("lora.rank=8", "lora.experts=true")
    assert dense.endswith("(a dense model); set lora.experts=false.")
    (text_only,) = errors_for("lora.rank=8", "lora.targets=[language,vision]", preset="llm-tiny")
    assert text_only.endswith("is text-only (model.vision: null); set lora.targets=[language].")
    (te,) = errors_for("lora.rank=8", "model.layer_backend=te")
    assert te.endswith("set model.layer_backend=flash (or sdpa).")
    stored = errors_for("lora.rank=8", "lora.targets=[language,vision]", "data.vision_embeddings=/nowhere")
    assert any(message.endswith("data.vision_embeddings runs neither (stored embeddings); set lora.targets=[language].")
               for message in stored)
    # The HF export merges the adapters into the base (tests/convert/test_lora_export.py): it needs one.
    assert load_run_config("qwen2.5vl-tiny", overrides=["lora.rank=8", "checkpoint.save_hf=true",
                                                        "checkpoint.load_hf=/models/base"]).checkpoint.save_hf
    (random_base,) = errors_for("lora.rank=8", "checkpoint.save_hf=true")
    assert random_base.endswith("set checkpoint.load_hf=BASE_HF_FOLDER or checkpoint.save_hf=false.")
    # rank 0 is LoRA off: the other keys are not read, so a leftover value is no error.
    load_run_config("qwen2.5vl-tiny", overrides=["lora.modules=[]"])


def _as_saved_before_the_sections(cfg) -> dict:
    """``cfg``'s tree as the main of before the moe / window / anyres sections wrote its config.yaml: every key
    flat, a section that is not built written as its "not built" flat values."""
    tree = to_dict(cfg)
    language, vision = tree["model"]["language"], tree["model"]["vision"]
    moe = language.pop("moe") or {"num_experts": 0, "ffn_hidden_size": None}
    language.update({old: moe[new] for old, new in MOVED_TO_MOE.items() if new in moe})
    if vision is not None:
        window = vision.pop("window") or {"size": None, "fullatt_block_indexes": []}
        anyres = vision.pop("anyres") or {"pinpoints": [], "max_crops": 9}
        vision.update(window_size=window["size"], fullatt_block_indexes=window["fullatt_block_indexes"],
                      anyres_pinpoints=anyres["pinpoints"], anyres_max_crops=anyres["max_crops"])
    return tree


@pytest.mark.parametrize("preset", ["qwen2.5vl-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "llava-onevision-tiny",
                                    "qwen3.5-moe-tiny"])
def test_a_config_yaml_written_before_the_sections_reads_back_as_the_same_run(preset, tmp_path, capsys):
    cfg = load_run_config(preset)
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_yaml_tree(_as_saved_before_the_sections(cfg)))
    assert load_resolved_config(saved) == cfg
    moved = capsys.readouterr().err.splitlines()
    print(f"{preset}: {len(moved)} lines, e.g. {moved[0]}")
    assert moved and all("is now model." in line for line in moved)


def test_a_towers_whole_width_q_k_norms_split_over_vision_tp_beside_per_head_ones_are_refused():
    """megatron sums every q/k norm's gradient over TP when the decoder has per-head ones: a tower's whole-width q/k
    norms split over vision TP would have their shards mixed; whole on each rank (vision TP 1) they train right
    (tests/train/test_composed_families_train.py)."""
    split = ["model.vision.qk_norm=true", "parallel.tensor_model_parallel_size=2", "parallel.world_size=2"]
    with pytest.raises(ConfigError, match=r"model.vision.qk_norm=true at vision TP 2 beside a decoder with per-head "
                                          r"q/k norms \(model.language.qk_norm\).*vision_tensor_model_parallel_size=1"):
        load_run_config("internvl3.5-tiny", overrides=split)
    whole = load_run_config("internvl3.5-tiny", overrides=[*split, "parallel.vision_tensor_model_parallel_size=1"])
    assert whole.model.vision.qk_norm and whole.parallel.vision_tensor_model_parallel_size == 1


def test_data_parallel_levers_are_on_at_dp_above_one_unless_set():
    """null = on wherever gradients are reduced over more than one rank (DP x CP > 1); a set value
    wins; the param gather is opt-in, and overlaps the distributed optimizer's all-gather only."""
    from loongforge.config.layout import DataParallelSettings, data_parallel_settings

    default = load_run_config("qwen2.5vl-tiny").parallel
    assert (default.use_distributed_optimizer, default.overlap_grad_reduce, default.overlap_param_gather) == (
        None, None, None)
    off = DataParallelSettings(False, False, False)
    assert data_parallel_settings(default, 1) == off
    assert data_parallel_settings(default, 2) == DataParallelSettings(True, True, False)
    gather = load_run_config("qwen2.5vl-tiny", overrides=["parallel.overlap_param_gather=true"]).parallel
    assert data_parallel_settings(gather, 2) == DataParallelSettings(True, True, True)
    assert data_parallel_settings(gather, 1) == DataParallelSettings(False, False, False)  # nothing to gather
    set_off = load_run_config("qwen2.5vl-tiny", overrides=["parallel.use_distributed_optimizer=false"]).parallel
    assert data_parallel_settings(set_off, 4) == DataParallelSettings(False, True, False)
    set_on = load_run_config("qwen2.5vl-tiny", overrides=["parallel.use_distributed_optimizer=true",
                                                          "parallel.overlap_grad_reduce=false"]).parallel
    assert data_parallel_settings(set_on, 1) == DataParallelSettings(True, False, False)
    assert DataParallelSettings(True, True, True).describe() == (
        "distributed optimizer, overlapped grad reduce, overlapped param gather")
    (message,) = errors_for("parallel.use_distributed_optimizer=false", "parallel.overlap_param_gather=true")
    assert message.startswith("parallel.overlap_param_gather=true overlaps the distributed optimizer's all-gather")


def test_preference_section_switches_on_with_one_key_and_checks_each_key_with_the_fix():
    files = ("data.source=files", "data.paths=[pairs.json]")
    assert load_run_config("llm-tiny").preference is None  # null: SFT
    dpo = load_run_config("llm-tiny", overrides=[*files, "preference.loss=sigmoid"]).preference
    assert (dpo.loss, dpo.beta, dpo.reference, dpo.rpo_alpha, dpo.label_smoothing) == ("sigmoid", 0.1, None, 0.0, 0.0)
    (name,) = errors_for(*files, "preference.loss=simpoo", preset="llm-tiny")
    assert name == ("preference.loss='simpoo' is not one of sigmoid | ipo | hinge | simpo | orpo; did you mean "
                    "'simpo'? set preference.loss to one of those (sigmoid is DPO).")
    beta, smoothing, alpha = errors_for(*files, "preference.beta=0", "preference.label_smoothing=0.5",
                                        "preference.rpo_alpha=-1", preset="llm-tiny")
    assert beta.startswith("preference.beta=0.0 must be positive") and alpha.startswith("preference.rpo_alpha=-1.0")
    assert smoothing.startswith("preference.label_smoothing=0.5 must be in [0, 0.5)")
    smoothed, orpo_alpha, reference = errors_for(*files, "preference.loss=orpo", "preference.label_smoothing=0.1",
                                                 "preference.rpo_alpha=1", "preference.reference=/ref",
                                                 preset="llm-tiny")
    assert smoothed.endswith("applies to sigmoid and simpo only, and preference.loss=orpo; set "
                             "preference.label_smoothing=0.")
    assert orpo_alpha.endswith("ORPO adds the chosen NLL at weight 1 itself; set preference.rpo_alpha=0.")
    assert reference.endswith("which is reference-free; set preference.reference=null.")
    (gamma,) = errors_for(*files, "preference.loss=simpo", "preference.simpo_gamma=-1", preset="llm-tiny")
    assert gamma.startswith("preference.simpo_gamma=-1.0 must not be negative")
    (synthetic,) = errors_for("preference.loss=sigmoid", preset="llm-tiny")
    assert synthetic.endswith("data.source=synthetic has none; set data.source=files and data.paths=[pairs.json].")


def test_preference_refuses_what_it_does_not_train_with_yet_naming_the_setting():
    files = ("data.source=files", "data.paths=[pairs.json]", "preference.loss=sigmoid")
    lora, vision = errors_for(*files, "lora.rank=8")
    assert vision.endswith("does not train with a vision tower yet; choose a text model's preset (model.vision: null).")
    assert lora == "preference.loss=sigmoid does not train with lora.rank > 0 yet; set lora.rank=0."
    (moe,) = errors_for(*files, preset="qwen3-moe-tiny")
    assert moe.endswith("does not train with mixture-of-experts layers yet; choose a dense model's preset "
                        "(model.language.moe: null).")
    (world,) = errors_for(*files, world_size=2, preset="llm-tiny")
    assert world.endswith("trains at one process, and this launch has 2; launch one process (parallel.world_size=1).")
