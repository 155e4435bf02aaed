"""RICE-ViT (``models/towers/rice_vit``, LLaVA-OneVision-1.5's tower), what the concern modules do not already
prove: its image processing is transformers' (Qwen2-VL's image processor at one frame a temporal patch) bit for
bit, and the class token's learned rotary angles, which every head reads while vision TP splits the heads, get
transformers' gradient on each rank at TP 2 (each rank's heads give a share, summed over the vision TP group)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

from loongforge.config.loader import load_run_config
from loongforge.config.schema import ParallelConfig
from loongforge.data.vision import load_rgb_image
from loongforge.models import parts
from loongforge.models.registry import get_family
from tests.data.conftest import COCO_IMAGES, require
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.references import REFERENCES

WORLD_SIZE = 2


def test_images_equal_transformers_image_processor_at_one_frame_a_patch():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = load_run_config("llava-onevision1.5-8b")
    images = parts.image_processing(get_family(cfg.model.family), cfg.model, cfg.data)
    reference = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=1,
                                         min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    rng = np.random.default_rng(0)
    odd = [Image.fromarray(rng.integers(0, 256, (61, 97, 3), dtype=np.uint8)),  # below min_pixels
           Image.fromarray(rng.integers(0, 256, (1500, 1400, 3), dtype=np.uint8))]  # above max_pixels
    photos = [Image.open(path) for path in sorted(require(COCO_IMAGES).glob("*.jpg"))[:4]]
    for image in photos + odd:
        expected = reference(images=[image], return_tensors="np")
        rows, grid = images.pixels(load_rgb_image(image))
        assert [list(grid)] == expected["image_grid_thw"].tolist()
        assert rows.shape == expected["pixel_values"].shape == (grid[1] * grid[2], 3 * 14 * 14)
        assert np.abs(rows - expected["pixel_values"]).max() == 0.0
    print(f"\n{len(photos) + 2} images: grids and pixel rows of 588 values bit-equal to transformers'")


def _class_rotary_worker(rank: int, port: int, workdir: str) -> None:
    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    reference = REFERENCES["llava_onevision1_5"]
    model_cfg, hf_model, model = reference.pair(ParallelConfig(tensor_model_parallel_size=WORLD_SIZE,
                                                               world_size=WORLD_SIZE))
    case = reference.sample(model_cfg, hf_model, **reference.layouts["two_images"])
    labels = torch.randint(0, model_cfg.language.vocab_size, case.ours["input_ids"].shape,
                           generator=torch.Generator().manual_seed(3))
    model(**case.ours, labels=labels).sum().backward()
    angles = model.vision_model.class_rotary
    grads = [torch.empty_like(angles.grad) for _ in range(WORLD_SIZE)]
    dist.all_gather(grads, angles.grad.contiguous())
    if rank == 0:
        F.cross_entropy(hf_model(**case.theirs).logits[0], labels[0], reduction="none").sum().backward()
        expected = hf_model.model.visual.cls_embeddings.class_pos_emb.grad[0]
        figures = dict(vision_tp=model.vision_model.layers[0].pg_collection.tp.size(),
                       diffs=[float((grad - expected).abs().max() / expected.abs().max()) for grad in grads])
        torch.save(figures, Path(workdir) / "figures.pt")
    destroy_megatron()


def test_class_token_rotary_angles_get_transformers_gradient_on_each_rank_at_vision_tp2(tmp_path):
    run_workers(_class_rotary_worker, WORLD_SIZE, (free_port(), str(tmp_path)), 300)
    figures = torch.load(tmp_path / "figures.pt")
    print(f"\nvision TP {figures['vision_tp']}: the class token's rotary-angle gradient per rank differs from "
          f"transformers' by {', '.join(f'{d:.1e}' for d in figures['diffs'])} of the largest")
    assert figures["vision_tp"] == WORLD_SIZE
    assert max(figures["diffs"]) <= 1e-5


def test_every_key_style_reads_as_the_one_written():
    """transformers' module names, the published checkpoints' (``model.layers.*``, the style written) and what its
    ``save_pretrained`` writes for a model it built (``model.model.*``) are one set of tensors: each style renamed
    is the weight map's HF keys."""
    import transformers

    reference = REFERENCES["llava_onevision1_5"]
    model_cfg = reference.model_cfg()
    family = get_family(model_cfg.family)
    with torch.device("meta"):
        modules = transformers.LlavaOnevision15ForConditionalGeneration(
            transformers.AutoConfig.for_model(**family.config_to_hf(model_cfg, "float32"))).state_dict()
    written = family.to_hub_style(modules)
    built = {("model.model." + key[len("model."):] if key.startswith("model.") else key): value
             for key, value in written.items()}
    assert family.to_hub_style(written).keys() == family.to_hub_style(built).keys() == written.keys()
    assert set(written) == set(family.hf_shapes(model_cfg))
    assert {"visual.class_pos_emb", "visual.merger.ln_q.weight", "model.layers.0.mlp.up_proj.weight",
            "lm_head.weight"} <= set(written)
    assert len(set(built) - set(written)) == sum(key.startswith("model.") for key in written) > 0


def test_settings_rice_vit_is_not_built_with_are_one_line_each():
    from loongforge.config.errors import ConfigError
    from loongforge.models import registry

    registry.check_family_layout(load_run_config("llava-onevision1.5-tiny"))
    cfg = load_run_config("llava-onevision1.5-tiny", overrides=[
        "model.vision.norm=rms", "model.vision.temporal_patch_size=2", "model.vision.hidden_size=72"])
    try:
        registry.check_family_layout(cfg)
    except ConfigError as error:
        messages = error.messages
    else:
        raise AssertionError("RICE-ViT built with RMSNorm, two frames a patch and 72-wide blocks")
    print("\n" + "\n".join(messages))
    assert [message.split("=")[0] for message in messages] == [
        "model.vision.norm", "model.vision.temporal_patch_size", "model.vision.hidden_size"]
