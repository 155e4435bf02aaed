"""An exported HF folder is ready to serve: for every model family, at its tiny preset, a megatron
checkpoint exported as HF (``mcore_to_hf``: the path ``convert --to hf`` and ``checkpoint.save_hf``
share) loads in transformers' Auto classes with a tokenizer, chat template, processors and
generation defaults, and on a real conversation they give exactly what loongforge trains on:
the rendered text, the token ids, and for a vision family each photo's pixels and patch grid.

A folder whose source had processor files keeps them, and each setting that differs from the
run's (here a larger ``max_pixels``) is one line of the report."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.processing_utils import ProcessorMixin, VideosKwargs

from loongforge.config.loader import load_run_config
from loongforge.config.schema import RunConfig
from loongforge.convert.engine import ConversionReport, hf_to_mcore, mcore_to_hf
from loongforge.convert.hf_io import read_header
from loongforge.convert.serving import processor_mismatches
from loongforge.data.collate import collate_row
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import SampleMeasurer, materialize, vision_sizing
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn, render_chat, turns_to_hf_messages
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.vlm.pixels import patch_rows
from loongforge.models.registry import families, get_family
from tests.data.conftest import LLAMAFACTORY, require
from tests.models.references import hub_named
from tests.shared_data import SHARED_DATA

# Text families are checked at every chat format they have: Qwen3's (llm-tiny) and Llama 3's; and DeepSeek-V3's
# architecture (with Qwen3's format, as its tiny preset trains); InternVL at each version's tokenizer and template.
# (A composition has no HF export: tests/train/test_composition_train.py.)
PRESETS = [get_family(name).tiny_preset for name in families() if get_family(name).hf_model_class] + [
    "llama-tiny", "deepseek-v3-tiny", "internvl2.5-tiny"]


@dataclass
class Export:
    cfg: RunConfig
    folder: Path
    report: ConversionReport

    @property
    def has_vision(self) -> bool:
        return self.cfg.model.vision is not None


def save_random_model(cfg: RunConfig, folder: Path) -> None:
    """A random transformers model of the preset's shapes saved as HF, with no tokenizer, processor
    or generation file (``save_pretrained`` writes generation defaults: removed, so the export
    writes its own)."""
    hf_config = transformers.AutoConfig.for_model(**get_family(cfg.model.family).config_to_hf(cfg.model, "float32"))
    torch.manual_seed(0)
    auto_class = transformers.AutoModelForImageTextToText if cfg.model.vision else transformers.AutoModelForCausalLM
    auto_class.from_config(hf_config).save_pretrained(folder)
    hub_named(folder, get_family(cfg.model.family).to_hub_style)
    (folder / "generation_config.json").unlink()


def export(preset: str, root: Path, source_files: dict[str, dict] | None = None) -> Export:
    """HF (random, plus ``source_files``) -> megatron checkpoint -> the exported HF folder."""
    cfg = load_run_config(preset)
    save_random_model(cfg, root / "source")
    for name, content in (source_files or {}).items():
        (root / "source" / name).write_text(json.dumps(content))
    hf_to_mcore(root / "source", root / "mcore", progress=False)
    report = mcore_to_hf(root / "mcore", root / "served", preset=preset, progress=False)
    return Export(cfg, root / "served", report)


@pytest.fixture(scope="module")
def exports() -> dict[str, Export]:
    """preset -> its export, made once for the module (a full-vocabulary export takes seconds)."""
    return {}


def export_once(exports: dict[str, Export], preset: str, tmp_path_factory) -> Export:
    if preset not in exports:
        exports[preset] = export(preset, tmp_path_factory.mktemp(preset))
    return exports[preset]


@pytest.fixture(scope="module", params=PRESETS)
def exported(request, exports, tmp_path_factory) -> Export:
    return export_once(exports, request.param, tmp_path_factory)


def load_processor(folder: Path):
    """``AutoProcessor.from_pretrained(folder)``. Where torchvision is missing (it has no build for
    this project's torch) transformers builds no video processor at all, so the processor class the
    folder names is built from the folder's own image processor, tokenizer and chat template, as
    ``from_pretrained`` would, with no video processor (this test gives it no video)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    settings = json.loads((folder / "processor_config.json").read_text())
    processor_class = getattr(transformers, settings["processor_class"])
    # The processor's own settings (InternVL's image_seq_length), as from_pretrained passes them.
    own = {key: value for key, value in settings.items()
           if key not in ("image_processor", "video_processor", "processor_class")}
    check = ProcessorMixin.check_argument_for_proper_class
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class",
                           lambda self, name, arg: None if arg is None else check(self, name, arg)):
        return processor_class(image_processor=transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True),
                               tokenizer=transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True),
                               video_processor=None, chat_template=(folder / "chat_template.jinja").read_text(), **own)


def real_conversation(has_vision: bool) -> ConversationSample:
    """LLaMA-Factory's first multimodal demo (two photos, two rounds) for a vision family; an
    arena-hard question with o3-mini's answer for a text family."""
    if has_vision:
        return FileSamples([str(require(LLAMAFACTORY / "mllm_demo.json"))]).get(0)
    answers = require(SHARED_DATA / "arena_hard" / "v2.0_model_answer_o3-mini-2025-01-31.jsonl")
    record = json.loads(answers.read_text(encoding="utf-8").splitlines()[0])
    turns = [Turn("user", record["messages"][0]["content"]), Turn("assistant", record["messages"][1]["content"]["answer"])]
    return ConversationSample(sample_id="arena-hard:1", file=str(answers), line=1, turns=turns)


def loongforge_batch(cfg: RunConfig, sample: ConversationSample) -> tuple[str, dict]:
    """The text loongforge renders and the micro-batch it trains on for ``sample`` alone."""
    family = get_family(cfg.model.family)
    chat = family.chat(cfg.model)
    measured = SampleMeasurer(load_tokenizer(cfg.data.tokenizer), cfg.data, cfg.model).measure(sample)
    sizing = vision_sizing(cfg.data, cfg.model)
    batch = collate_row([materialize(measured, sizing)], pad_to_multiple=1, pad_token_id=cfg.model.tokens.pad_token_id,
                        position_ids=family.position_ids(cfg.model))
    return render_chat(sample.turns, cfg.data.system_prompt, chat).text, batch


def hf_pixel_rows(cfg: RunConfig, inputs, batch: dict) -> np.ndarray:
    """transformers' pixel values as the patch rows loongforge trains on, once their grids are checked:
    Qwen's processor gives rows and ``image_grid_thw``; InternVL's, tiles [n, C, S, S] (the grids' t);
    LLaVA-OneVision's, each image's squares padded to the most any image has, and ``image_sizes``."""
    images = batch["media"].images
    if "image_grid_thw" in inputs:
        assert torch.equal(inputs["image_grid_thw"], images.grids)
        return inputs["pixel_values"].numpy()
    tiles = inputs["pixel_values"].numpy()
    squares = images.grids[:, 0].tolist()
    if tiles.ndim == 5:  # LLaVA-OneVision's: [images, most squares, C, S, S], each image's squares first
        assert torch.equal(inputs["image_sizes"], images.sizes)
        tiles = np.concatenate([image[:count] for image, count in zip(tiles, squares)])
    assert tiles.shape[0] == sum(squares)
    return patch_rows(tiles, cfg.model.vision.patch_size)


def test_the_folder_holds_every_file_a_server_reads(exported):
    names = {path.name for path in exported.folder.iterdir()}
    expected = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja"} | ({"processor_config.json"} if exported.has_vision else set())
    assert expected <= names, sorted(names)
    written = "tokenizer, processor, generation" if exported.has_vision else "tokenizer, generation"
    assert f"{written} files written from the run's settings" in exported.report.notes
    assert not exported.report.serving_warnings
    # The Hub's tensor names, as transformers' save_pretrained wrote the source (not its module names).
    source, served = _tensor_headers(exported.folder.parent / "source"), _tensor_headers(exported.folder)
    print(f"{exported.cfg.model.family}: {len(served)} tensors served, {len(source.items() ^ served.items())} "
          f"names or dtypes unlike the source's")
    assert served == source, sorted(source.items() ^ served.items())[:4]
    if exported.has_vision:
        processor = json.loads((exported.folder / "processor_config.json").read_text())
        data, vision = exported.cfg.data, exported.cfg.model.vision
        image = processor["image_processor"]
        assert image["image_mean"] == list(vision.pixel_mean)
        if vision.arch == "intern_vit":  # tiles of the tower's size, at most data.max_tiles of them
            assert image["size"] == {"height": vision.image_size, "width": vision.image_size}
            assert (image["crop_to_patches"], image["max_patches"]) == (True, data.max_tiles)
            return
        if vision.arch == "siglip":  # squares of the tower's size on the run's anyres canvases
            assert image["size"] == {"height": vision.image_size, "width": vision.image_size}
            assert image["image_grid_pinpoints"] == [list(p) for p in vision.anyres.pinpoints]
            assert processor["vision_aspect_ratio"] == f"anyres_max_{vision.anyres.max_crops}"
            return
        if vision.arch == "ernie_vit":  # images alone, smart-resized within the run's pixel bounds
            assert image["size"] == {"shortest_edge": data.min_pixels, "longest_edge": data.max_pixels}
            assert image["patch_size"] == vision.patch_size
            return
        video = processor["video_processor"]
        assert image["size"] == {"shortest_edge": data.min_pixels, "longest_edge": data.max_pixels}
        assert video["size"] == {"shortest_edge": data.video_min_pixels, "longest_edge": data.video_max_pixels}
        assert image["patch_size"] == video["patch_size"] == vision.patch_size
        assert (video["fps"], video["max_frames"]) == (data.video_fps, data.video_max_frames)
        assert image["image_mean"] == video["image_mean"]


def _tensor_headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) of every safetensors file of ``folder``."""
    return {key: (info["dtype"], tuple(info["shape"])) for file in folder.glob("*.safetensors")
            for key, info in read_header(file)[0].items() if key != "__metadata__"}


def test_transformers_serves_what_loongforge_trains_on(exported):
    sample = real_conversation(exported.has_vision)
    text, batch = loongforge_batch(exported.cfg, sample)
    messages = turns_to_hf_messages(sample.turns)
    if exported.has_vision:
        processor = load_processor(exported.folder)
        assert processor.apply_chat_template(messages, tokenize=False) == text
        images = [Image.open(path) for path in sample.images]
        # One text, its images nested under it (a processor that treats a sample of several images otherwise,
        # LLaVA-OneVision's, counts them per text).
        inputs = processor(text=[text], images=[images], return_tensors="pt")
        # Bit-equal, as transformers' PIL image processors and loongforge's are (tests/data/test_vision.py,
        # tests/models/test_intern_vit_processor.py).
        assert np.abs(hf_pixel_rows(exported.cfg, inputs, batch) - batch["media"].images.rows.numpy()).max() == 0.0
        model = transformers.AutoModelForImageTextToText.from_pretrained(exported.folder, local_files_only=True)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(exported.folder, local_files_only=True)
        assert tokenizer.apply_chat_template(messages, tokenize=False) == text
        inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        model = transformers.AutoModelForCausalLM.from_pretrained(exported.folder, local_files_only=True)
    assert torch.equal(inputs["input_ids"], batch["input_ids"])
    images = batch["media"].images
    media = (f", grids {images.grids.tolist()} equal, pixel rows {tuple(images.rows.shape)} "
             f"bit-equal" if exported.has_vision else "")
    print(f"\n{exported.cfg.preset}: {len(text)}-character conversation, {inputs['input_ids'].shape[1]} token ids "
          f"equal{media}")
    prompt_length = inputs["input_ids"].shape[1]
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert prompt_length < generated.shape[1] <= prompt_length + 3  # a random model may end its turn early


def test_processor_files_of_the_source_are_kept_and_differences_reported(tmp_path):
    cfg = load_run_config("qwen2.5vl-tiny")
    processor = get_family(cfg.model.family).hf_processor_files(cfg.model, cfg.data)["processor_config.json"]
    processor["image_processor"]["size"]["longest_edge"] = 4 * cfg.data.max_pixels
    done = export("qwen2.5vl-tiny", tmp_path, {"processor_config.json": processor})
    copied = json.loads((done.folder / "processor_config.json").read_text())
    assert copied["image_processor"]["size"]["longest_edge"] == 4 * cfg.data.max_pixels
    source = tmp_path / "mcore" / "hf" / "processor_config.json"
    assert done.report.serving_warnings == [
        f"{source}: image_processor.size.longest_edge is {4 * cfg.data.max_pixels}, the run's data settings "
        f"give {cfg.data.max_pixels} (copied as it is)"]
    assert done.report.summary().splitlines()[1:] == done.report.serving_warnings
    assert load_processor(done.folder).image_processor.size["longest_edge"] == 4 * cfg.data.max_pixels


def test_processor_files_of_older_hub_folders_are_checked_too(tmp_path):
    """Hub folders saved before transformers 5 keep each processor in a file of its own, the pixel
    bounds as min_pixels / max_pixels."""
    cfg = load_run_config("qwen3vl-tiny")
    expected = get_family(cfg.model.family).hf_processor_files(cfg.model, cfg.data)
    image = {"min_pixels": cfg.data.min_pixels, "max_pixels": 12845056, "patch_size": 14,
             "image_processor_type": "Qwen2VLImageProcessor"}
    video = {"size": {"shortest_edge": cfg.data.video_min_pixels, "longest_edge": cfg.data.video_max_pixels},
             "fps": cfg.data.video_fps, "video_processor_type": "Qwen3VLVideoProcessor"}
    files = {"preprocessor_config.json": image, "video_preprocessor_config.json": video}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    lines = processor_mismatches({name: tmp_path / name for name in files}, expected)
    assert lines == [
        f"{tmp_path / 'preprocessor_config.json'}: max_pixels is 12845056, the run's data settings give "
        f"{cfg.data.max_pixels} (copied as it is)",
        f"{tmp_path / 'preprocessor_config.json'}: patch_size is 14, the run's data settings give 16 (copied as it is)"]


def test_a_tokenizer_of_another_model_is_not_written(exports, tmp_path_factory, tmp_path):
    """No run config and no --preset: the default data settings name Qwen's tokenizer, which a
    Llama checkpoint must not be served with; the weights are exported all the same. The megatron
    checkpoint is the one the served llama-tiny folder above was exported from."""
    llama = export_once(exports, "llama-tiny", tmp_path_factory)
    report = mcore_to_hf(llama.folder.parent / "mcore", tmp_path / "guessed", progress=False)
    assert report.serving_warnings == [
        "tokenizer and generation files not written: data.tokenizer=qwen is not this model's tokenizer "
        "(model.tokens.pad_token_id=128004 but the tokenizer's pad token <|endoftext|> is 151643); set "
        "data.tokenizer to the model's own (convert: --preset NAME)"]
    names = {path.name for path in (tmp_path / "guessed").iterdir()}
    assert "model.safetensors" in names and not names & {"tokenizer.json", "generation_config.json"}


def _takes_videos(name: str) -> bool:
    """A family that serves (an HF class) and whose processor takes videos."""
    family = get_family(name)
    return bool(family.hf_model_class and family.has_vision
                and family.chat(load_run_config(family.tiny_preset).model).video_block)


@pytest.mark.parametrize("preset", [get_family(name).tiny_preset for name in families() if _takes_videos(name)])
def test_every_video_setting_is_one_its_processor_reads(preset):
    """transformers' video processors need torchvision (no build for this project's torch), so the
    section is checked against what the class declares it reads: the generic video settings and its
    own init keywords, read from its source."""
    cfg = load_run_config(preset)
    video = get_family(cfg.model.family).hf_processor_files(cfg.model, cfg.data)["processor_config.json"]["video_processor"]
    module = {"Qwen2VLVideoProcessor": "qwen2_vl/video_processing_qwen2_vl.py",
              "Qwen3VLVideoProcessor": "qwen3_vl/video_processing_qwen3_vl.py"}[video["video_processor_type"]]
    tree = ast.parse((Path(transformers.__file__).parent / "models" / module).read_text())
    init_kwargs = next(node for node in tree.body if isinstance(node, ast.ClassDef)
                       and node.name == f"{video['video_processor_type']}InitKwargs")
    own = {node.target.id for node in init_kwargs.body if isinstance(node, ast.AnnAssign)}
    assert set(video) - {"video_processor_type"} <= own | set(VideosKwargs.__annotations__)


def test_a_config_written_from_the_model_gets_the_tokenizers_ids(tmp_path, caplog):
    """A folder exported without an HF source (a training run's save_hf at the small vocabulary):
    config.json gets the tokenizer's end-of-turn and pad ids (BOS: Qwen has none, its configs name
    <|endoftext|>, the pad token), instead of transformers' class defaults (Qwen's full-vocabulary
    151643 / 151645, outside a 4,224-token vocabulary)."""
    from loongforge.convert.serving import write_serving_files

    cfg = load_run_config("qwen2.5vl-tiny-small-vocab")
    (tmp_path / "config.json").write_text(json.dumps(get_family(cfg.model.family).config_to_hf(cfg.model), indent=2))
    write_serving_files(tmp_path, cfg.model, cfg.data, None)
    written = json.loads((tmp_path / "config.json").read_text())
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    print({key: written[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    assert written["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>") < cfg.model.language.vocab_size
    assert written["pad_token_id"] == written["bos_token_id"] == cfg.model.tokens.pad_token_id
    with caplog.at_level("WARNING"):
        config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.text_config.eos_token_id == written["eos_token_id"]
    assert not [r for r in caplog.records if "token_id" in r.getMessage()], caplog.text
