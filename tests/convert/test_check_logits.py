"""``loongforge convert SRC --check-logits`` on tiny random checkpoints: the --check-logits concern, every
reference of ``tests.models.references.REFERENCES`` (or the test or reference that proves its path, ``PROVEN_BY``)
agrees with transformers, a media family on a real photo sized as training sizes it; a wrong weight fails with exit
1, bad input is a one-line exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pytest

from loongforge.convert import check_logits
from tests.console import assert_no_third_party_warning, console_of
from tests.convert.helpers import invoke, one_line_error, save_hf_checkpoint
from tests.models.helpers import run_workers, tiny_model_cfg
from tests.models.references import REFERENCES, Reference, assert_proven_once, runs
from tests.shared_data import SHARED_DATA

TOLERANCE = 1e-5
COCO_PHOTO = SHARED_DATA / "coco2017" / "val2017" / "000000161044.jpg"  # 640 x 229: a 16 x 46 patch grid


def _save_checked(reference: Reference, path: Path) -> None:
    """A preset reference at its preset's full vocabulary (the tokenizer's ids and vision tokens), 2 decoder layers,
    untied; a reference's own model as it is."""
    if reference.preset is None:
        reference.save_hf(path)
    else:
        reference.save_hf(path, num_layers=2,
                          overrides=("model.language.tie_word_embeddings=false", *reference.two_layer_overrides))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Callable[[str], Path]:
    """Reference name -> its folder as this module checks it, written once for the module."""
    root = tmp_path_factory.mktemp("hf")

    def folder(name: str) -> Path:
        if not (root / name).exists():
            _save_checked(REFERENCES[name], root / name)
        return root / name
    return folder


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


# Each family's weights and math at TP 2 are proven against transformers by tests/models' TP tests; the command's
# spawned ranks at TP 2 once for text (test_tp2_in_two_processes) and once for media with a per-image fact of
# its own (LLaVA-OneVision's image sizes): the other references check at TP 1 here.
CHECKED_AT_TP2 = {"llava_onevision"}


def _ranks_forked(job) -> None:
    """``check_logits._spawn`` with the ranks forked from the session's fork server (``run_workers``: torch,
    megatron-core and the model code imported once) instead of fresh interpreters: the same ranks
    (``_spawned_rank``), the same job pickled to them. The command's own spawning is test_tp2_in_two_processes'."""
    run_workers(check_logits._spawned_rank, job.tp, (job,), timeout_s=300)


def test_every_reference_checks_or_names_its_prover():
    assert_proven_once("check_logits", globals())
    unsized = [name for name in runs("check_logits") if REFERENCES[name].has_media and not REFERENCES[name].photo_grid]
    assert not unsized, f"{unsized}: a media reference names the patch grid of the photo (Reference.photo_grid)"


@pytest.mark.parametrize("name", runs("check_logits"))
def test_every_reference_agrees_with_transformers(name, folders, monkeypatch):
    """A media reference on a real photo sized as training sizes it for its family (Qwen3-VL: patch 16, learned
    positions, DeepStack, 32 px per merged token; InternVL3.5's tiles and pixel shuffle, LLaVA-OneVision's anyres
    packing (also at TP 2), both under 1-D RoPE, transformers given the tiles or padded squares its processor
    returns; Qwen3.5's Gated DeltaNet layer and gated attention layer); a text reference on the built-in chat in
    its architecture's chat format. A preset's folder (full vocabulary, every parameter at 0.1 std: logits up to
    ~6) is measured against its largest logit."""
    reference = REFERENCES[name]
    image = ["--image", str(COCO_PHOTO)] if reference.has_media else []
    atol = ["--atol", str(reference.check_atol)] if reference.check_atol else []
    monkeypatch.setattr(check_logits, "_spawn", _ranks_forked)
    for tp in ("1", "2") if name in CHECKED_AT_TP2 else ("1",):
        result = invoke(str(folders(name)), "--check-logits", *image, "--tp", tp, "--json", *atol)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        relative = report["max_abs_diff"] / report["reference_max_abs_logit"]
        figure = relative if reference.preset else report["max_abs_diff"]
        assert report["passed"] and figure <= reference.check_bound, report
        assert report["argmax_agree"] == report["tokens"], report
        assert not reference.has_media or reference.photo_grid in report["sample"], report["sample"]
        print(f"\n{name} at TP {tp}: max abs diff {report['max_abs_diff']:.1e} ({relative:.1e} of the largest "
              f"logit) over {report['tokens']} tokens, {report['sample']}; asserted {reference.check_bound:.0e}"
              f"{' of the largest' if reference.preset else ''}")


def test_a_loongforge_checkpoint_is_checked_through_its_hf_export(folders, tmp_path):
    """Qwen3's folder converted to megatron, written back as HF and checked (qwen3's check: ``PROVEN_BY``)."""
    assert invoke(str(folders("qwen3")), str(tmp_path / "mcore"), "--to", "mcore").exit_code == 0
    result = invoke(str(tmp_path / "mcore"), "--check-logits")
    _passes(result)
    assert "was converted to HF" in result.stdout


def test_a_wrong_weight_fails(folders, monkeypatch):
    """One tensor of the converted weights scaled (a q_proj, as a faulty conversion would leave it):
    loongforge's model no longer computes what transformers does. (A tensor damaged in SRC itself
    reaches both models alike; the check compares the mapping and the model, not two copies.)"""
    load = check_logits.load_hf_state_dict

    def load_scaled(model, hf_state):
        key = "model.layers.1.self_attn.q_proj.weight"
        load(model, {**hf_state, key: hf_state[key] * 3})

    monkeypatch.setattr(check_logits, "load_hf_state_dict", load_scaled)
    result = invoke(str(folders("qwen2")), "--check-logits")
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1].startswith("verdict: FAIL")
    assert _max_diff(result) > 1e-2


def test_tp2_in_two_processes(folders, capfd):
    """Qwen2 (q/k/v biases, untied): the 300-row vocabulary is padded to 512 and split over 2 ranks (qwen2's check:
    ``PROVEN_BY``)."""
    result, stderr = console_of(capfd, lambda: invoke(str(folders("qwen2")), "--check-logits", "--tp", "2", "--json"))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "convert --check-logits --tp 2")  # this process's and both ranks'
    report = json.loads(result.stdout)
    assert report["tp"] == 2 and report["passed"] and report["max_abs_diff"] <= TOLERANCE


def test_bad_input_is_one_line_exit_2(folders, tmp_path):
    result = invoke(str(tmp_path / "missing"), "--check-logits")
    assert result.exit_code == 2
    assert one_line_error(result) == f"error: {tmp_path / 'missing'}: no such file or folder"
    result = invoke(str(folders("llama")), "--check-logits", "--image", str(COCO_PHOTO))
    assert result.exit_code == 2 and "text-only; drop --image" in one_line_error(result)
    result = invoke(str(folders("llama")), "--check-logits", "--tp", "3")
    assert result.exit_code == 2 and "--tp" in result.output
    result = invoke(str(folders("llama")), str(tmp_path / "out"), "--check-logits")
    assert result.exit_code == 2 and "--check-logits takes SRC only" in one_line_error(result)
    result = invoke(str(folders("llama")), "--atol", "1e-3")
    assert result.exit_code == 2 and "go with --check-logits" in one_line_error(result)


def test_a_missing_image_is_one_line_exit_2(vl_folder, tmp_path):
    result = invoke(str(vl_folder), "--check-logits", "--image", str(tmp_path / "none.jpg"))
    assert result.exit_code == 2
    assert one_line_error(result).startswith(f"error: --image {tmp_path / 'none.jpg'}:")
