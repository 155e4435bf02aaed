"""The registered vision parts (``models.parts``) and a VLM as their composition: every VLM family
names a registered tower, the presets state their parts, a run's ``model.vision.arch`` /
``model.projector.arch`` are checked against the family in one line each, and a family's FLOP count
is its tower's plus the shared decoder's."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from loongforge.balance.cost_model import SampleCost
from loongforge.cli.app import app
from loongforge.config.errors import ConfigError
from loongforge.config.layout import derive_parallel_sizes
from loongforge.config.loader import load_run_config
from loongforge.models import parts, registry
from loongforge.models.family import ANY_TOWER
from loongforge.models.flops import FlopOptions, step_flops
from loongforge.models.vlm.encoder import VisionEncoder
from loongforge.train.dry_run import encoder_activation_bytes, human_count


@pytest.mark.parametrize("name", [name for name in registry.families() if registry.get_family(name).has_vision])
def test_every_vision_family_is_composed_of_a_registered_tower(name):
    family = registry.get_family(name)
    cfg = load_run_config(family.tiny_preset)
    tower = parts.tower(family.tower(cfg.model))
    assert tower.arch == (cfg.model.vision.arch if family.vision_part == ANY_TOWER else family.vision_part)
    assert issubclass(tower.encoder_type(), VisionEncoder)
    assert (cfg.model.vision.arch, cfg.model.projector.arch) == (tower.arch, tower.projectors[0])
    # The family counts its tower's FLOPs and the shared decoder's, nothing else.
    samples = [SampleCost(tokens=200, patches=(64, 192), loss_tokens=40, grids=((1, 8, 8), (2, 8, 12)))]
    vision, projector = tower.flops(cfg.model, [(1, 8, 8), (2, 8, 12)], FlopOptions())
    assert family.training_flops(cfg.model, samples) == step_flops(cfg.model, samples, FlopOptions(), vision=vision,
                                                                   projector=projector)
    assert vision > 0 and projector > 0


def test_text_only_families_name_no_tower():
    assert registry.get_family("llm").vision_part is None


@pytest.mark.parametrize("override, message", [
    ("model.vision.arch=qwen3_vit", "model.vision.arch='qwen3_vit': model.family=qwen2_5_vl is composed of the "
                                    "'qwen2_5_vit' tower; set model.vision.arch=qwen2_5_vit or leave it null"),
    ("model.vision.arch=qwen3_vitt", "model.vision.arch='qwen3_vitt' is not a vision tower of loongforge "
                                     f"({' | '.join(parts.towers())}); did you mean 'qwen3_vit'?"),
    ("model.projector.arch=deepstack_mergers", "model.projector.arch='deepstack_mergers': the 'qwen2_5_vit' tower "
                                               "is built with patch_merger; set model.projector.arch=patch_merger"),
])
def test_a_part_the_family_is_not_composed_of_is_one_line_and_exit_2(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        registry.check_family_layout(load_run_config("qwen2.5vl-tiny", overrides=[override]))
    result = CliRunner().invoke(app, ["train", "--preset", "qwen2.5vl-tiny", "--dry-run", override])
    assert result.exit_code == 2 and message in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1


def test_null_parts_mean_the_familys_own():
    cfg = load_run_config("qwen3vl-tiny", overrides=["model.vision.arch=null", "model.projector.arch=null"])
    registry.check_family_layout(cfg)


def test_the_dry_run_states_the_composition_with_each_parts_parameters():
    cfg = load_run_config("qwen2.5vl-7b")
    vision, projector = parts.tower("qwen2_5_vit").parameters(cfg.model)
    language = registry.get_family("qwen2_5_vl").count_parameters(cfg.model)["language_model"]
    result = CliRunner().invoke(app, ["train", "--preset", "qwen2.5vl-7b", "--dry-run"])
    (line,) = [line for line in result.output.splitlines() if "composed of" in line]
    print(line.strip(), vision, projector, language)
    assert line.split("composed of")[1].strip() == (
        f"vision tower qwen2_5_vit {human_count(vision)} + projector patch_merger {human_count(projector)} "
        f"+ language model {human_count(language)}")
    assert "composed of" not in CliRunner().invoke(app, ["train", "--preset", "llm-tiny", "--dry-run"]).output


def test_a_tower_outside_loongforge_is_named_by_its_import_path():
    part = parts.tower("tests.train.made_up_tower")
    assert part.arch == "tests.train.made_up_tower" and part.projectors == ("mlp",)
    with pytest.raises(ConfigError, match=r"^model.vision.arch=tests.no_such_tower: no module 'tests.no_such_tower' "
                                          r"to import; give a tower of loongforge \(ernie_vit \| intern_vit \| "):
        parts.tower("tests.no_such_tower")
    with pytest.raises(ConfigError, match=r"^model.vision.arch=tests.shared_data: the module exports no PART = "
                                          r"TowerPart\(arch='tests.shared_data', ...\); export one$"):
        parts.tower("tests.shared_data")


# The tiny preset of each tower, and how many intermediate-width values its MLP saves per patch: Qwen2.5-ViT's
# SwiGLU keeps gate, up and their product; the plain GELU MLPs of the others keep the up projection and its
# activation.
TOWER_PRESETS = {"qwen2_5_vit": ("qwen2.5vl-tiny", 3), "qwen3_vit": ("qwen3vl-tiny", 2),
                 "intern_vit": ("internvl3.5-tiny", 2), "siglip": ("llava-onevision-tiny", 2)}


@pytest.mark.parametrize("tower", sorted(TOWER_PRESETS))
def test_the_dry_runs_encoder_activations_are_the_towers_own(tower):
    """The plan's vision activations per rank (``encoder_dp=none``) count what each tower's blocks save:
    4 h whole and 4 h + m i split over the vision TP per patch and block, m its MLP's (3 gated, 2 plain)."""
    preset, mlp_values = TOWER_PRESETS[tower]
    cfg = load_run_config(preset, overrides=["parallel.tensor_model_parallel_size=2", "parallel.world_size=2"])
    assert parts.tower(registry.get_family(cfg.model.family).tower(cfg.model)).arch == tower
    sizes = derive_parallel_sizes(cfg.parallel)
    vis, value_bytes = cfg.model.vision, 4 if cfg.training.precision == "fp32" else 2
    patches = cfg.data.seq_len * cfg.model.projector.spatial_merge_size ** 2
    in_flight = min(sizes.pipeline_parallel, cfg.training.global_batch_size // sizes.data_parallel)
    split = 4 * vis.hidden_size + mlp_values * vis.intermediate_size
    per_patch = 4 * vis.hidden_size + split / sizes.vision_tensor_parallel
    expected = in_flight * patches * vis.depth * value_bytes * per_patch
    planned = encoder_activation_bytes(cfg, sizes)["none"]
    print(f"\n{tower}: {planned / 2**20:.2f} MiB of vision activations per rank (vision TP "
          f"{sizes.vision_tensor_parallel})")
    assert planned == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("preset, override, message", [
    ("llava-onevision-tiny", "model.vision.norm=rms", "model.vision.norm='rms': SigLIP's blocks use LayerNorm; set "
                                                      "model.vision.norm=layer"),
    ("internvl3.5-tiny", "model.projector.spatial_merge_size=1", "model.projector.spatial_merge_size=1: InternVL's "
                                                                 "pixel shuffle merges 2 x 2 patches"),
    ("qwen2.5vl-tiny", "model.vision.window=null", "model.vision.window is null: Qwen2.5-ViT attends inside windows"),
    ("llava-onevision-tiny", "model.vision.anyres=null", "model.vision.anyres is null: LLaVA-OneVision's processor"),
])
def test_a_towers_own_checks_stop_the_run_before_it_starts(preset, override, message):
    """A tower's settings it cannot be built with (``TowerPart.config_problems``) are one line naming the key and
    the fix at the dry run, before any rank starts (they were a ValueError at the first rank's build)."""
    with pytest.raises(ConfigError, match=message):
        registry.check_family_layout(load_run_config(preset, overrides=[override]))
    result = CliRunner().invoke(app, ["train", "--preset", preset, "--dry-run", override])
    print(f"\n{result.output.strip().splitlines()[-1]}")
    assert result.exit_code == 2 and message in result.output
