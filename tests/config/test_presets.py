"""Every shipped preset composes, validates at its own layout and matches its published size."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from loongforge.config.layout import derive_parallel_sizes
from loongforge.config.loader import dump_yaml, load_resolved_config, load_run_config
from loongforge.config import presets as presets_module
from loongforge.config.presets import DEFAULT_PRESET, PRESETS_ENV_VAR, list_preset_names, presets_dir
from loongforge.config.validate import check_run_config

PRESETS = list_preset_names()


def test_presets_folder_has_the_shipped_presets():
    assert {"qwen2.5vl-3b", "qwen2.5vl-7b", "qwen2.5vl-32b", "qwen2.5vl-72b",
            *CPU_PRESETS} <= set(PRESETS)


def test_presets_ship_inside_the_package_and_the_wheel_declares_every_file(monkeypatch):
    """The presets are package data: every YAML under loongforge/presets must match a pattern of
    pyproject.toml's package-data, or an installed wheel lacks it (scripts/check_wheel.sh installs
    one and dry-runs every preset)."""
    monkeypatch.delenv(PRESETS_ENV_VAR, raising=False)
    assert presets_dir() == Path(presets_module.__file__).resolve().parents[1] / "presets"
    repo = Path(__file__).resolve().parents[2]
    root = repo / "loongforge" / "presets"
    patterns = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {path for pattern in patterns["loongforge.presets"] for path in root.glob(pattern)}
    assert set(root.rglob("*.yaml")) == shipped
    assert {path.stem for path in shipped if path.parent == root} == set(list_preset_names(root))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_validates(name):
    cfg = load_run_config(name)
    assert cfg.preset == name
    assert check_run_config(cfg) == []
    sizes = derive_parallel_sizes(cfg.parallel)
    assert sizes.data_parallel * sizes.tensor_parallel * sizes.pipeline_parallel == sizes.world_size


@pytest.mark.parametrize("name", PRESETS)
def test_resolved_yaml_round_trips(name, tmp_path):
    cfg = load_run_config(name)
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_resolved_config(path) == cfg


# Toy sizes for CPU runs: no published checkpoint to match.
TINY_PRESETS = {DEFAULT_PRESET, "llm-tiny", "llama-tiny", "qwen3vl-tiny", "qwen3-moe-tiny", "qwen3vl-moe-tiny",
                "internvl3.5-tiny", "llava-onevision-tiny", "composition-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny",
                "deepseek-v3-tiny", "ernie4.5vl-tiny"}
CPU_PRESETS = {"qwen2.5vl-tiny-vit", *TINY_PRESETS, *(f"{name}-small-vocab" for name in TINY_PRESETS)}


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_every_tiny_preset_has_a_small_vocabulary_variant_of_the_same_architecture(name):
    """The tests train the variants: they must differ from the preset in the vocabulary alone."""
    full, small = load_run_config(name), load_run_config(f"{name}-small-vocab")
    assert small.data.tokenizer == f"{full.data.tokenizer}-small"
    assert small.model.language.vocab_size in (4224, 4352)
    different = {(section, key) for section in ("model", "data") for key in vars(getattr(full, section))
                 if getattr(getattr(full, section), key) != getattr(getattr(small, section), key)}
    assert different == {("model", "language"), ("model", "tokens"), ("data", "tokenizer")}, different
    assert dataclasses.replace(small.model.language, vocab_size=full.model.language.vocab_size) == full.model.language


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in CPU_PRESETS])
def test_full_size_presets_match_published_parameter_counts(name):
    from loongforge.models.registry import get_family

    cfg = load_run_config(name)
    assert cfg.model.reference_num_params is not None
    assert get_family(cfg.model.family).count_parameters(cfg.model)["total"] == cfg.model.reference_num_params


def test_7b_preset_is_the_schema_default_model():
    from loongforge.config.schema import LanguageConfig, VisionConfig

    cfg = load_run_config("qwen2.5vl-7b")
    assert cfg.model.language == LanguageConfig()
    assert cfg.model.vision == VisionConfig(arch="qwen2_5_vit")
    assert cfg.model.reference_num_params == 8_292_166_656


def test_tiny_preset_has_the_agreed_dimensions():
    cfg = load_run_config(DEFAULT_PRESET)
    vision, language = cfg.model.vision, cfg.model.language
    assert (vision.depth, vision.hidden_size) == (2, 64)
    assert (vision.num_heads, vision.intermediate_size) == (4, 128)
    assert (vision.patch_size, vision.temporal_patch_size, vision.window.size) == (14, 2, 112)
    assert vision.window.fullatt_block_indexes == [1]
    assert cfg.model.projector.spatial_merge_size == 2
    assert cfg.model.projector.out_hidden_size == 128
    assert (language.num_layers, language.hidden_size, language.ffn_hidden_size) == (4, 128, 384)
    assert (language.num_attention_heads, language.num_query_groups) == (4, 2)
    assert language.mrope_section == [4, 6, 6]
    assert (language.vocab_size, language.rope_theta) == (151936, 1e6)
    assert language.tie_word_embeddings
    assert (cfg.data.source, cfg.data.seq_len, cfg.data.tokenizer) == ("synthetic", 1024, "qwen")
    assert (cfg.data.max_pixels, cfg.data.min_pixels) == (224 * 224, 56 * 56)
    assert (cfg.training.precision, cfg.training.device) == ("fp32", "cpu")
    assert (cfg.training.global_batch_size, cfg.training.train_steps) == (4, 150)
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (1e-3, 1e-4)
    assert cfg.optimizer.weight_decay == 0.0
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay_style) == (10, "cosine")
    assert cfg.optimizer.clip_grad == 1.0
    assert (cfg.logging.output_dir, cfg.logging.log_interval) == ("runs/qwen2.5vl-tiny", 10)
    assert cfg.checkpoint.save_at_end


def test_tiny_vit_preset_is_encoder_heavy_at_tp2_with_encoder_dp():
    """The encoder-DP bench's preset: the vision tower outweighs the whole language model
    (embedding included) in parameters, and an image costs the encoder more FLOPs than its
    tokens cost the language model; TP2 with a whole encoder per rank, dividing the images."""
    from loongforge.balance.cost_model import SampleCost
    from loongforge.models.registry import get_family

    cfg = load_run_config("qwen2.5vl-tiny-vit")
    counts = get_family("qwen2_5_vl").count_parameters(cfg.model)
    assert counts["vision_model"] > counts["language_model"]
    assert (cfg.model.vision.depth, cfg.model.vision.hidden_size) == (6, 512)
    assert cfg.model.language == load_run_config(DEFAULT_PRESET).model.language
    grid = (1, 26, 36)  # a 640 x 480 photo at the preset's 448 x 448 pixel limit
    assert cfg.data.max_pixels == 448 * 448
    image_tokens = grid[1] * grid[2] // cfg.model.projector.spatial_merge_size ** 2
    image = SampleCost(tokens=image_tokens, patches=(grid[0] * grid[1] * grid[2],), grids=(grid,))
    flops = get_family(cfg.model.family).training_flops(cfg.model, [image])
    assert flops.vision + flops.projector > 10 * flops.language
    parallel = cfg.parallel
    assert (parallel.world_size, parallel.tensor_model_parallel_size) == (2, 2)
    assert (parallel.vision_tensor_model_parallel_size, parallel.encoder_dp) == (1, "tp")
    assert (cfg.training.device, cfg.training.precision) == ("cpu", "fp32")


def test_presets_env_var_points_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("training:\n  train_steps: 7\n")
    monkeypatch.setenv("LOONGFORGE_PRESETS", str(tmp_path))
    assert presets_dir() == tmp_path
    assert list_preset_names() == ["mine"]
    assert load_run_config("mine").training.train_steps == 7


def test_llama_presets_use_llama3s_tokenizer_and_architecture():
    """The preset overrides the training component's tokenizer: Llama 3's vocabulary, pad token and
    (chosen by the architecture) chat format."""
    from loongforge.models.decoder.text_config import architecture

    for name in ("llama3.1-8b", "llama-tiny"):
        cfg = load_run_config(name)
        assert (cfg.model.family, cfg.data.tokenizer) == ("llm", "llama3")
        assert architecture(cfg.model.language) == "LlamaForCausalLM"
        assert (cfg.model.language.vocab_size, cfg.model.tokens.pad_token_id) == (128256, 128004)
    tiny = load_run_config("llama-tiny")
    language = tiny.model.language
    assert (language.num_layers, language.hidden_size, language.rope_scaling_factor) == (4, 128, 8.0)
    assert language.tie_word_embeddings and (tiny.training.device, tiny.data.source) == ("cpu", "synthetic")

