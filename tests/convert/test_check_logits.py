"""``loongforge convert SRC --check-logits`` on tiny random checkpoints: every family and architecture
agrees with transformers to 1e-5, a wrong weight fails with exit 1, bad input is a one-line exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loongforge.convert import check_logits
from tests.console import assert_no_third_party_warning, console_of
from tests.convert.helpers import invoke, one_line_error, save_hf_checkpoint
from tests.models.helpers import run_workers, tiny_model_cfg
from tests.models.llm_helpers import ARCHITECTURES, DEEPSEEK_ARCHITECTURES, build_hf_llm
from tests.shared_data import SHARED_DATA

TOLERANCE = 1e-5
COCO_PHOTO = SHARED_DATA / "coco2017" / "val2017" / "000000161044.jpg"  # 640 x 229: a 16 x 46 patch grid


@pytest.fixture(scope="module")
def llm_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm")
    for arch in ARCHITECTURES:
        build_hf_llm(arch).save_pretrained(root / arch)
    return {arch: root / arch for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> Path:
    """Untied, Hub key style in two shards: the layout of a real Qwen2.5-VL download."""
    folder = tmp_path_factory.mktemp("vl") / "hub"
    save_hf_checkpoint(folder, tiny_model_cfg(tie=False), style="hub")
    return folder


def _max_diff(result) -> float:
    (value,) = re.findall(r"^max abs diff\s+(\S+)", result.stdout, flags=re.M)
    return float(value)


def _passes(result) -> float:
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("verdict: PASS")
    diff = _max_diff(result)
    assert diff <= TOLERANCE
    return diff


def test_qwen2_5_vl_with_the_built_in_image(vl_folder):
    result = invoke(str(vl_folder), "--check-logits")
    _passes(result)
    assert "patch grid [1, 8, 10]" in result.stdout
    tokens = int(re.search(r"(\d+) tokens", result.stdout).group(1))
    assert f"argmax agree    {tokens}/{tokens}" in result.stdout


def test_qwen2_5_vl_with_a_photo(vl_folder):
    result = invoke(str(vl_folder), "--check-logits", "--image", str(COCO_PHOTO), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["max_abs_diff"] <= TOLERANCE
    assert "patch grid [1, 16, 46]" in report["sample"]  # sized as training sizes it
    assert report["argmax_agree"] == report["tokens"] and report["vocab_size"] == 151936


def test_qwen3_vl_with_a_photo(tmp_path):
    """Qwen3-VL's tower (patch 16, learned positions, DeepStack) on a real photo sized as training sizes
    it for this family (32 px per merged token, 0.5 / 0.5 normalisation)."""
    from tests.models.test_qwen3_vl_support import build_hf_model
    from tests.models.test_qwen3_vl_support import tiny_model_cfg as qwen3_vl_tiny

    build_hf_model(qwen3_vl_tiny()).save_pretrained(tmp_path / "hf")
    result = invoke(str(tmp_path / "hf"), "--check-logits", "--image", str(COCO_PHOTO), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["max_abs_diff"] <= TOLERANCE
    assert report["argmax_agree"] == report["tokens"]


# A real photo tiled or cropped as training does it for each composed family, at its tiny preset's size
# (full vocabulary, 2 decoder layers): InternVL's 12 tiles and a thumbnail of 56 px, LLaVA-OneVision's base
# square and its anyres crops of 56 px (packed by the photo's size); Qwen3.5's smart-resized patch grid through
# one Gated DeltaNet layer and one gated attention layer (its layer_types cut to the two layers).
COMPOSED = {"internvl": "patch grid [13, 4, 4]", "llava_onevision": "patch grid [7, 4, 4]",
            "qwen3_5": "patch grid [1, 14, 40]", "qwen3_5_moe": "patch grid [1, 14, 40]"}


# Each family's weights and math at TP 2 are proven against transformers by tests/models' TP tests; the command's
# spawned ranks at TP 2 once for text (test_tp2_in_two_processes) and once for media with a per-image fact of
# its own (LLaVA-OneVision's image sizes): the other families check at TP 1 here.
CHECKED_AT_TP2 = {"llava_onevision"}


def _ranks_forked(job) -> None:
    """``check_logits._spawn`` with the ranks forked from the session's fork server (``run_workers``: torch,
    megatron-core and the model code imported once) instead of fresh interpreters: the same ranks
    (``_spawned_rank``), the same job pickled to them. The command's own spawning is test_tp2_in_two_processes'."""
    run_workers(check_logits._spawned_rank, job.tp, (job,), timeout_s=300)


@pytest.mark.parametrize("family", sorted(COMPOSED))
def test_composed_families_with_a_photo(family, tmp_path, monkeypatch):
    """InternVL3.5 (InternViT, pixel shuffle, Qwen3) and LLaVA-OneVision (SigLIP, MLP, anyres packing,
    Qwen2; also at TP 2) under 1-D RoPE; transformers gets the tiles or padded squares its processor returns.
    Qwen3.5 and Qwen3.5-MoE (a Gated DeltaNet layer and a gated attention layer; the MoE's routed and shared
    experts)."""
    import torch
    import transformers

    from loongforge.config.loader import load_run_config
    from loongforge.models.registry import get_family
    from tests.models.tower_helpers import randomised

    hybrid = ["model.language.layer_types=[linear_attention,full_attention]"] if family.startswith("qwen3_5") else []
    preset = "qwen3.5-moe-tiny" if family == "qwen3_5_moe" else get_family(family).tiny_preset
    family = family.removesuffix("_moe")
    cfg = load_run_config(preset, overrides=["model.language.num_layers=2", "model.language.tie_word_embeddings=false",
                                             *hybrid])
    config = transformers.AutoConfig.for_model(**get_family(family).config_to_hf(cfg.model, "float32"))
    torch.manual_seed(0)
    randomised(transformers.AutoModelForImageTextToText.from_config(config)).save_pretrained(tmp_path / "hf")
    # Qwen3.5's logits reach ~12 here and its recurrence's fp32 summation order moves them by ~1e-5 of that
    # (measured 9.7e-6 at TP 1, 9.0e-6 at TP 2): its bounds are 3x that, absolute and relative.
    atol = ["--atol", "5e-4"] if family == "qwen3_5" else []
    bound = 3e-5 if family == "qwen3_5" else TOLERANCE
    monkeypatch.setattr(check_logits, "_spawn", _ranks_forked)
    for tp in ("1", "2") if family in CHECKED_AT_TP2 else ("1",):
        result = invoke(str(tmp_path / "hf"), "--check-logits", "--image", str(COCO_PHOTO), "--tp", tp, "--json", *atol)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        # Relative to the logits' scale (every parameter at 0.1 std: logits up to ~6).
        relative = report["max_abs_diff"] / report["reference_max_abs_logit"]
        assert report["passed"] and relative <= bound, report
        assert report["argmax_agree"] == report["tokens"] and COMPOSED[family] in report["sample"], report["sample"]
        print(f"\n{family} at TP {tp}: max abs diff {report['max_abs_diff']:.1e} ({relative:.1e} of the largest "
              f"logit) over {report['tokens']} tokens, {report['sample']}")


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_llm_architectures(llm_folders, arch):
    _passes(invoke(str(llm_folders[arch]), "--check-logits"))


@pytest.mark.parametrize("arch", list(DEEPSEEK_ARCHITECTURES))
def test_deepseek(arch, tmp_path):
    """Multi-latent attention, DeepSeekMoE routing (V3: the expert bias, groups); at TP 2 in
    tests/models/test_tp_parity.py (CHECKED_AT_TP2)."""
    build_hf_llm(arch).save_pretrained(tmp_path / arch)
    diff = _passes(invoke(str(tmp_path / arch), "--check-logits"))
    print(f"\n{arch} at TP 1: max abs diff {diff:.1e}")


def test_a_loongforge_checkpoint_is_checked_through_its_hf_export(llm_folders, tmp_path):
    assert invoke(str(llm_folders["qwen3"]), str(tmp_path / "mcore"), "--to", "mcore").exit_code == 0
    result = invoke(str(tmp_path / "mcore"), "--check-logits")
    _passes(result)
    assert "was converted to HF" in result.stdout


def test_a_wrong_weight_fails(llm_folders, monkeypatch):
    """One tensor of the converted weights scaled (a q_proj, as a faulty conversion would leave it):
    loongforge's model no longer computes what transformers does. (A tensor damaged in SRC itself
    reaches both models alike; the check compares the mapping and the model, not two copies.)"""
    load = check_logits.load_hf_state_dict

    def load_scaled(model, hf_state):
        key = "model.layers.1.self_attn.q_proj.weight"
        load(model, {**hf_state, key: hf_state[key] * 3})

    monkeypatch.setattr(check_logits, "load_hf_state_dict", load_scaled)
    result = invoke(str(llm_folders["qwen2"]), "--check-logits")
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1].startswith("verdict: FAIL")
    assert _max_diff(result) > 1e-2


def test_tp2_in_two_processes(llm_folders, capfd):
    """Qwen2 (q/k/v biases, untied): the 300-row vocabulary is padded to 512 and split over 2 ranks."""
    result, stderr = console_of(capfd, lambda: invoke(str(llm_folders["qwen2"]), "--check-logits", "--tp", "2", "--json"))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "convert --check-logits --tp 2")  # this process's and both ranks'
    report = json.loads(result.stdout)
    assert report["tp"] == 2 and report["passed"] and report["max_abs_diff"] <= TOLERANCE


def test_bad_input_is_one_line_exit_2(llm_folders, tmp_path):
    result = invoke(str(tmp_path / "missing"), "--check-logits")
    assert result.exit_code == 2
    assert one_line_error(result) == f"error: {tmp_path / 'missing'}: no such file or folder"
    result = invoke(str(llm_folders["llama"]), "--check-logits", "--image", str(COCO_PHOTO))
    assert result.exit_code == 2 and "text-only; drop --image" in one_line_error(result)
    result = invoke(str(llm_folders["llama"]), "--check-logits", "--tp", "3")
    assert result.exit_code == 2 and "--tp" in result.output
    result = invoke(str(llm_folders["llama"]), str(tmp_path / "out"), "--check-logits")
    assert result.exit_code == 2 and "--check-logits takes SRC only" in one_line_error(result)
    result = invoke(str(llm_folders["llama"]), "--atol", "1e-3")
    assert result.exit_code == 2 and "go with --check-logits" in one_line_error(result)


def test_a_missing_image_is_one_line_exit_2(vl_folder, tmp_path):
    result = invoke(str(vl_folder), "--check-logits", "--image", str(tmp_path / "none.jpg"))
    assert result.exit_code == 2
    assert one_line_error(result).startswith(f"error: --image {tmp_path / 'none.jpg'}:")
