"""The registry of tiny transformers references: one builder per family (and per variant where the math
differs), each giving what a concern module needs: our config, the transformers model with every
parameter random, our model for a parallel layout, and sample inputs in both forms (ours and
transformers'), text alone or with media where the family has media: one image, two images, a video, an
image and a video (the Qwen-VL families, random pixels); one photo and two photos through the family's own
processor (InternVL's tiles; LLaVA-OneVision's anyres squares for a sample's only image, a padded square
each for two).

A family joins every concern (``test_parity.py``: TP 1; ``test_tp_parity.py``: TP 2 with and without
sequence parallelism; ``test_lora_parity.py``; tests/convert's HF round trip and ``--check-logits``, which write the
reference as transformers' folder: ``Reference.save_hf``) by adding one ``Reference`` to ``REFERENCES``. Where two
references prove the same code path in a concern, ``PROVEN_BY`` says which one proves it (docs/testing.md)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from PIL import Image

from loongforge.config.loader import load_run_config
from loongforge.config.schema import DataConfig, LanguageConfig, ModelConfig, ParallelConfig, ProjectorConfig
from loongforge.config.schema import TokenIdsConfig
from loongforge.config.schema import AnyresConfig, VisionConfig
from loongforge.models import parts
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.internvl.model import build_model as build_internvl
from loongforge.models.llava_onevision.model import build_model as build_llava_onevision
from loongforge.models.llava_onevision1_5.hf_mapping import to_hub_style as llava_onevision1_5_hub_style
from loongforge.models.llava_onevision1_5.model import build_model as build_llava_onevision1_5
from loongforge.models.llm.model import build_model as build_llm
from loongforge.models.media import MediaBatch
from loongforge.models.qwen2_5_vl.model import build_model as build_qwen2_5_vl
from loongforge.models.qwen3_5.hf_mapping import to_hub_style as qwen3_5_hub_style
from loongforge.models.qwen3_5.model import build_model as build_qwen3_5
from loongforge.models.qwen3_vl.hf_mapping import to_hub_style as qwen3_vl_hub_style
from loongforge.models.qwen3_vl.model import build_model as build_qwen3_vl
from loongforge.models.registry import get_family
from loongforge.models.towers.intern_vit.processor import TileSettings, preprocess_tiles, tokens_per_tile
from loongforge.models.llava_onevision.anyres import anyres_crops, anyres_settings, anyres_tokens, square_padded
from loongforge.models.vlm.pixels import patch_rows
from tests.models import ernie_helpers as ernie
from tests.models import helpers as qwen2_5_vl
from tests.models import test_qwen3_vl_support as qwen3_vl
from tests.models.llm_helpers import ARCHITECTURES_WITH_MOE, build_hf_llm, text_positions, tiny_llm_cfg
from tests.models.tower_helpers import randomised
from tests.shared_data import SHARED_DATA

@dataclasses.dataclass
class Case:
    """One sample in both forms: ``ours`` the keyword arguments of our model's forward (positions
    included), ``theirs`` those of the transformers model."""

    ours: dict
    theirs: dict

    @property
    def length(self) -> int:
        return self.ours["input_ids"].shape[1]


@dataclasses.dataclass(frozen=True)
class Reference:
    """One family variant. ``layouts``: media layout name -> keyword arguments of ``sample``;
    ``relative``: tolerances are of the largest reference value (the gated delta rule's fp32 summation
    order moves Qwen3.5's logits by about 2e-6 of the largest) instead of absolute."""

    name: str
    model_cfg: Callable[[], ModelConfig]
    hf_model: Callable[[ModelConfig], torch.nn.Module]
    build: Callable[..., torch.nn.Module]  # (model_cfg, parallel_cfg, **build options) -> ours, fp32 CPU
    sample: Callable[..., Case]  # (model_cfg, hf_model, *, seed, text_len, **layout) -> Case
    layouts: dict = dataclasses.field(default_factory=lambda: {"text": {}})
    # The media layouts of the packed-row checks' first two samples (the third is text); a text-only
    # reference packs text alone.
    packed_media: tuple[str, str] = ("one_image", "video")
    relative: bool = False
    tolerance: float = 1e-5
    # transformers' state dict -> the Hub's key style, where our writer (``megatron_to_hf``) writes that style
    to_hub_style: Optional[Callable[[dict], dict]] = None
    # The command-line concerns (tests/convert) write the reference as transformers' folder (``save_hf``).
    # ``preset``: the tiny preset whose shapes the folder takes (the family's config.json through transformers'
    # Auto class, every parameter random) where the reference's own model will not do: ``--check-logits``
    # tokenizes with the preset's tokenizer, whose vision tokens a media model must hold. None: the reference's own.
    preset: Optional[str] = None
    # Decoder layers of the folder the round trip splits over PP 2 (None: its own): both DeepStack layers on the
    # first stage; DeepSeek's dense first layer and a sparse one on each stage.
    pp2_layers: Optional[int] = None
    # ``save_pretrained``'s options for the round trip's folder (LLaVA-OneVision: in shards with an index)
    roundtrip_save: dict = dataclasses.field(default_factory=dict)
    # ``--check-logits`` on a photo: the patch grid it reports, the photo sized as training sizes it for the family
    photo_grid: Optional[str] = None
    # ``--check-logits``' preset folder has two decoder layers: the overrides that needs (Qwen3.5: one of each kind)
    two_layer_overrides: tuple[str, ...] = ()
    # ``--check-logits``: the bound on the largest logit difference (of the largest logit for a preset's folder),
    # and the command's ``--atol`` where its default (1e-4, absolute) is too tight for the preset's logits
    check_bound: float = 1e-5
    check_atol: Optional[float] = None

    @property
    def has_media(self) -> bool:
        return len(self.layouts) > 1

    def difference(self, ours: torch.Tensor, reference: torch.Tensor) -> float:
        """The worst difference, absolute or relative to the reference's largest value."""
        diff = float((ours - reference).abs().max())
        return diff / float(reference.abs().max()) if self.relative else diff

    def pair(self, parallel_cfg: Optional[ParallelConfig] = None, **options):
        """(ModelConfig, transformers model, ours holding its weights, eval mode); needs megatron's state."""
        model_cfg = self.model_cfg()
        hf_model = self.hf_model(model_cfg)
        model = self.build(model_cfg, parallel_cfg or ParallelConfig(), **options).eval()
        load_hf_state_dict(model, hf_model.state_dict())
        return model_cfg, hf_model, model

    def save_hf(self, path: Path, *, num_layers: Optional[int] = None, small_vocabulary: bool = False,
                overrides: tuple[str, ...] = (), **save_options) -> int:
        """transformers' model written by ``save_pretrained(path, **save_options)`` with ``num_layers`` decoder
        layers (None: the model's own); the number of tensors written (the Hub's names; a tied head is not
        written). A preset reference: the preset's shapes with the config ``overrides``; otherwise the reference's
        own model. ``small_vocabulary``: the family's small test vocabulary (its ``-small-vocab`` preset's size and
        token ids) where the model's own is larger, for a concern that tokenizes nothing."""
        if self.preset is None:
            if overrides:
                raise ValueError(f"{self.name}: the reference's own model takes no preset overrides")
            model_cfg = _resized(self.model_cfg(), num_layers, small_vocabulary)
            model = self.hf_model(model_cfg)
        else:
            layers = [f"model.language.num_layers={num_layers}"] if num_layers else []
            model_cfg, model = _preset_hf_model(f"{self.preset}-small-vocab" if small_vocabulary else self.preset,
                                                [*layers, *overrides])
        model.save_pretrained(path, **save_options)
        hub_named(path, get_family(model_cfg.family).to_hub_style)
        # transformers 5 saves routed experts as the Hub does (one tensor per expert): count what it wrote.
        written = get_family(model_cfg.family).to_hub_style(model.state_dict())
        return len(written) - int(model_cfg.language.tie_word_embeddings)


def hub_named(path: Path, to_hub_style: Callable[[dict], dict]) -> None:
    """The folder's tensors under the Hub's names, as a published folder holds them: transformers writes a model
    it built (not loaded) under names of its own for some classes (LLaVA-OneVision-1.5's ``model.model.*``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    names = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as opened:  # the names alone: most folders need no renaming
            keys = list(opened.keys())
        hub = {key: next(iter(to_hub_style({key: None}))) for key in keys}
        if any(key != name for key, name in hub.items()):
            names.update(hub)
            save_file({hub[key]: tensor for key, tensor in load_file(shard).items()}, shard, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if names and index.is_file():
        content = json.loads(index.read_text())
        content["weight_map"] = {names.get(key, key): shard for key, shard in content["weight_map"].items()}
        index.write_text(json.dumps(content, indent=2))


def _resized(model_cfg: ModelConfig, num_layers: Optional[int], small_vocabulary: bool) -> ModelConfig:
    """``model_cfg`` with ``num_layers`` decoder layers, and the family's small test vocabulary where asked and
    smaller than its own."""
    language, tokens = model_cfg.language, model_cfg.tokens
    if num_layers is not None:
        language = dataclasses.replace(language, num_layers=num_layers)
    if small_vocabulary:
        small = load_run_config(f"{get_family(model_cfg.family).tiny_preset}-small-vocab").model
        if small.language.vocab_size < language.vocab_size:
            language, tokens = dataclasses.replace(language, vocab_size=small.language.vocab_size), small.tokens
    return dataclasses.replace(model_cfg, language=language, tokens=tokens)


def _preset_hf_model(preset: str, overrides: list[str]) -> tuple[ModelConfig, torch.nn.Module]:
    """(the preset's model config, transformers' model of the config.json the family writes of it, every
    parameter random)."""
    import transformers

    model_cfg = load_run_config(preset, overrides=overrides).model
    config = transformers.AutoConfig.for_model(**get_family(model_cfg.family).config_to_hf(model_cfg, "float32"))
    torch.manual_seed(0)
    return model_cfg, randomised(transformers.AutoModelForImageTextToText.from_config(config))


def build_options(**options) -> dict:
    return dict(params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu", **options)


@torch.no_grad()
def reference_logits(hf_model, case: Case) -> torch.Tensor:
    """[1, s, V] logits of the transformers model."""
    return hf_model(**case.theirs).logits


def packed(cases: list[Case]) -> Case:
    """One thd row of ``cases`` (ours only: transformers runs each sample alone); the media in
    sample order, as the data pipeline packs them."""
    lengths = [case.length for case in cases]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    ours = dict(
        input_ids=torch.cat([case.ours["input_ids"] for case in cases], dim=1),
        position_ids=torch.cat([case.ours["position_ids"] for case in cases], dim=2),
        packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)),
    )
    ours["media"] = qwen2_5_vl.cat_media([case.ours["media"] for case in cases if "media" in case.ours])
    return Case(ours=ours, theirs={})


def even_length(reference: Reference, model_cfg, hf_model, **layout) -> Case:
    """A sample of even length: sequence parallelism splits the sequence in two."""
    case = reference.sample(model_cfg, hf_model, **layout)
    return case if case.length % 2 == 0 else reference.sample(model_cfg, hf_model, text_len=13, **layout)


# ---------------------------------------------------------------------------------------------------
# Qwen2.5-VL, Qwen3-VL, Qwen3.5: a vision tower, M-RoPE positions from transformers' own get_rope_index
# ---------------------------------------------------------------------------------------------------


def _vlm_sample(support) -> Callable[..., Case]:
    def sample(model_cfg, hf_model, *, seed: int = 0, text_len: int = 12, **layout) -> Case:
        drawn = support.make_sample(model_cfg, seed=seed, text_len=text_len, **layout)
        positions = support.hf_position_ids(hf_model, drawn)
        media = dict(pixel_values=drawn.pixel_values, image_grid_thw=drawn.image_grid_thw,
                     pixel_values_videos=drawn.pixel_values_videos, video_grid_thw=drawn.video_grid_thw)
        return Case(ours=support.our_inputs(drawn, positions),
                    theirs=dict(input_ids=drawn.input_ids, position_ids=positions, **media))
    return sample


def qwen3_5_model_cfg(moe: bool = False) -> ModelConfig:
    """qwen3.5-tiny (or qwen3.5-moe-tiny: 8 routed experts, top-2, and a gated shared expert in every layer)."""
    model_cfg = load_run_config("qwen3.5-moe-tiny" if moe else "qwen3.5-tiny").model
    model_cfg.layer_backend = "sdpa"
    return model_cfg


def qwen3_5_hf_model(model_cfg, seed: int = 0):
    """A random fp32 transformers Qwen3.5 (Qwen3.5-MoE with experts): every parameter drawn anew (the
    zero-centred norms, Gated DeltaNet's convolution, decays and gated norm included), norms around their
    identity scale."""
    import transformers

    config = transformers.AutoConfig.for_model(**get_family("qwen3_5").config_to_hf(model_cfg, "float32"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") and "language_model" not in name else 0.0
            if name.endswith("linear_attn.norm.weight"):
                centre = 1.0  # the gated norm scales by its weight, the others by 1 + weight
            torch.nn.init.normal_(param, mean=centre, std=0.1 if "norm" in name else 0.05, generator=generator)
    return model


def _build_qwen2_5_vl(model_cfg, parallel_cfg, **options):
    return build_qwen2_5_vl(model_cfg, parallel_cfg, **build_options(**options))


def _build_qwen3_vl(model_cfg, parallel_cfg, **options):
    return build_qwen3_vl(model_cfg, parallel_cfg, vision=qwen3_vl.TINY_VISION, **build_options(**options))


def _build_qwen3_5(model_cfg, parallel_cfg, **options):
    return build_qwen3_5(model_cfg, parallel_cfg, **build_options(**options))


QWEN2_5_VL_LAYOUTS = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),  # 2 windows, one partial
    "two_images": dict(images=((1, 8, 12), (1, 20, 16))),  # different sizes, partial windows
    "video": dict(videos=((2, 8, 8),)),  # 2 temporal patches
    "image_and_video": dict(images=((1, 8, 12),), videos=((2, 8, 8),)),
}
QWEN3_VL_LAYOUTS = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),  # position grid 6x6 resampled up to 8x12
    "two_images": dict(images=((1, 8, 12), (1, 6, 4))),  # different sizes; 6x4 resamples down
    "video": dict(videos=((3, 4, 6),)),  # 3 frames, each after its own timestamp
    "image_and_video": dict(images=((1, 6, 4),), videos=((2, 4, 6),)),
}
QWEN3_5_LAYOUTS = {name: layout for name, layout in QWEN3_VL_LAYOUTS.items() if name != "image_and_video"}


# ---------------------------------------------------------------------------------------------------
# InternVL3.5 (InternViT on tiles, Qwen3) and LLaVA-OneVision (SigLIP on anyres squares, Qwen2): 1-D RoPE,
# real photos through the family's own processor at the tiny tile size. Images only: loongforge trains
# neither family on videos (InternVL's processor writes a video as frames of images; LLaVA-OneVision's
# video path is refused, ``llava_onevision/chat.py``).
# ---------------------------------------------------------------------------------------------------

COMPOSED_VOCAB, COMPOSED_IMAGE_TOKEN = 1000, 999
# Two COCO photos of different proportions: 640 x 457 (landscape) and 480 x 640 (portrait).
WIDE_PHOTO, TALL_PHOTO = (SHARED_DATA / "coco2017" / "val2017" / name for name in ("000000020247.jpg",
                                                                                   "000000012280.jpg"))
COMPOSED_LAYOUTS = {
    "text": dict(),
    "one_image": dict(photos=(WIDE_PHOTO,)),  # LLaVA-OneVision: the sample's only image goes anyres
    "two_images": dict(photos=(WIDE_PHOTO, TALL_PHOTO)),  # LLaVA-OneVision: one padded square each
}
INTERNVL_TILE, LLAVA_SQUARE, PATCH = 56, 60, 14  # 4 x 4 patches (LLaVA's square leaves 4 pixels a side)
# LLaVA-OneVision's canvases: up to 3 x 2 squares of 60 px, as the published 384 px ones are of up to 6 x 6.
LLAVA_PINPOINTS = [[60, 60], [60, 120], [120, 60], [120, 120], [120, 180], [180, 120]]


# Neither tiny vocabulary's random text reaches the image token or the unused ids below it.
COMPOSED_TOKENS = TokenIdsConfig(image_token_id=COMPOSED_IMAGE_TOKEN, video_token_id=998, vision_start_token_id=997,
                                 vision_end_token_id=996, pad_token_id=0)


def internvl_model_cfg() -> ModelConfig:
    """InternViT (2 blocks of width 32, 56-pixel tiles: 4 tokens a tile after the pixel shuffle), Qwen3."""
    return ModelConfig(
        family="internvl",
        vision=VisionConfig(arch="intern_vit", depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                            in_channels=3, patch_size=PATCH, temporal_patch_size=1, image_size=INTERNVL_TILE,
                            window=None, rms_norm_eps=1e-6, hidden_act="gelu",
                            norm="layer"),
        projector=ProjectorConfig(arch="pixel_shuffle_mlp", spatial_merge_size=2, hidden_act="gelu",
                                  out_hidden_size=64),
        language=LanguageConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                num_query_groups=2, head_dim=16, qk_norm=True, add_qkv_bias=False,
                                vocab_size=COMPOSED_VOCAB, rope_theta=1e6, mrope_section=[],
                                tie_word_embeddings=False),
        tokens=dataclasses.replace(COMPOSED_TOKENS), layer_backend="sdpa")


def internvl_hf_model(model_cfg: ModelConfig, seed: int = 0, text_config: Optional[dict] = None):
    """transformers' InternVL of ``internvl_model_cfg``, every parameter drawn at random (layer scales,
    class token, positions and norms included); ``text_config``: the decoder's, where not Qwen3's."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    vis, lang = model_cfg.vision, model_cfg.language
    config = InternVLConfig(
        vision_config=dict(hidden_size=vis.hidden_size, num_hidden_layers=vis.depth, num_attention_heads=vis.num_heads,
                           intermediate_size=vis.intermediate_size, image_size=[vis.image_size] * 2,
                           patch_size=[vis.patch_size] * 2, attention_bias=True, use_qk_norm=False,
                           norm_type="layer_norm", layer_norm_eps=1e-6, use_mean_pooling=True, hidden_act="gelu"),
        text_config=text_config or dict(
            model_type="qwen3", vocab_size=lang.vocab_size, hidden_size=lang.hidden_size,
            intermediate_size=lang.ffn_hidden_size, num_hidden_layers=lang.num_layers,
            num_attention_heads=lang.num_attention_heads, num_key_value_heads=lang.num_query_groups,
            head_dim=lang.head_dim, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": lang.rope_theta},
            tie_word_embeddings=False),
        image_token_id=model_cfg.tokens.image_token_id, downsample_ratio=0.5, projector_hidden_act="gelu",
        tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomised(InternVLForConditionalGeneration(config).eval())


def internvl2_5_model_cfg() -> ModelConfig:
    """``internvl_model_cfg`` on InternVL2.5's decoder: Qwen2.5 (q/k/v biases, no q/k norm) with the dynamic
    NTK RoPE scaling its configs state, plain RoPE up to max_position_embeddings."""
    cfg = internvl_model_cfg()
    cfg.language = dataclasses.replace(cfg.language, head_dim=None, qk_norm=False, add_qkv_bias=True,
                                       architecture="Qwen2ForCausalLM", max_position_embeddings=1024,
                                       rope_scaling_factor=2.0, rope_scaling_type="dynamic")
    return cfg


def internvl2_5_hf_model(model_cfg: ModelConfig, seed: int = 0):
    """transformers' InternVL of ``internvl2_5_model_cfg`` (a Qwen2 text config with dynamic RoPE), every
    parameter drawn at random."""
    lang = model_cfg.language
    text_config = dict(model_type="qwen2", vocab_size=lang.vocab_size, hidden_size=lang.hidden_size,
                       intermediate_size=lang.ffn_hidden_size, num_hidden_layers=lang.num_layers,
                       num_attention_heads=lang.num_attention_heads, num_key_value_heads=lang.num_query_groups,
                       rms_norm_eps=1e-6, max_position_embeddings=lang.max_position_embeddings,
                       rope_parameters={"rope_type": "dynamic", "factor": lang.rope_scaling_factor,
                                        "rope_theta": lang.rope_theta},
                       tie_word_embeddings=False)
    return internvl_hf_model(model_cfg, seed, text_config=text_config)


def llava_onevision_model_cfg() -> ModelConfig:
    """SigLIP (2 blocks of width 32, 60-pixel squares) with anyres canvases of up to 3 x 2 squares, Qwen2."""
    return ModelConfig(
        family="llava_onevision",
        vision=VisionConfig(arch="siglip", depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                            patch_size=PATCH, temporal_patch_size=1, image_size=LLAVA_SQUARE, window=None,
                            rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", norm="layer",
                            anyres=AnyresConfig(pinpoints=LLAVA_PINPOINTS)),
        projector=ProjectorConfig(arch="mlp", spatial_merge_size=1, hidden_act="gelu", out_hidden_size=64),
        language=LanguageConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                num_query_groups=2, vocab_size=COMPOSED_VOCAB, rope_theta=1e6, mrope_section=[],
                                add_qkv_bias=True, tie_word_embeddings=False),
        tokens=dataclasses.replace(COMPOSED_TOKENS), layer_backend="sdpa")


def llava_onevision_hf_model(model_cfg: ModelConfig, seed: int = 0):
    """transformers' LLaVA-OneVision of ``llava_onevision_model_cfg``, every parameter drawn at random."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    vis, lang = model_cfg.vision, model_cfg.language
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=vis.hidden_size, num_hidden_layers=vis.depth,
                           num_attention_heads=vis.num_heads, intermediate_size=vis.intermediate_size,
                           image_size=vis.image_size, patch_size=vis.patch_size, layer_norm_eps=1e-6,
                           hidden_act="gelu_pytorch_tanh", vision_use_head=False),
        text_config=dict(model_type="qwen2", vocab_size=lang.vocab_size, hidden_size=lang.hidden_size,
                         intermediate_size=lang.ffn_hidden_size, num_hidden_layers=lang.num_layers,
                         num_attention_heads=lang.num_attention_heads, num_key_value_heads=lang.num_query_groups,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": lang.rope_theta},
                         tie_word_embeddings=False),
        image_token_index=model_cfg.tokens.image_token_id, vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_grid_pinpoints=vis.anyres.pinpoints,
        projector_hidden_act="gelu", multimodal_projector_bias=True)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomised(LlavaOnevisionForConditionalGeneration(config).eval())


@functools.lru_cache(maxsize=None)
def _photo(path: Path) -> Image.Image:
    return Image.open(path).convert("RGB")


@functools.lru_cache(maxsize=None)
def _internvl_tiles(path: Path, size: int) -> torch.Tensor:
    """The processor's tiles of a photo [tiles, 3, size, size]: the grid row by row, then the thumbnail."""
    return torch.from_numpy(preprocess_tiles(_photo(path), TileSettings(size=size, max_tiles=4)))


def _composed_case(model_cfg, seed: int, text_len: int, images: list[tuple[torch.Tensor, int]]) -> tuple:
    """(input ids [1, s], positions [3, 1, s], pixel rows of every square's whole patches): ``text_len``
    tokens, then each image's placeholders (``(squares [n, C, S, S], tokens)``) and 4 more tokens."""
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, COMPOSED_IMAGE_TOKEN - 10, (text_len,), generator=generator)]
    for _, tokens in images:
        pieces += [torch.full((tokens,), model_cfg.tokens.image_token_id),
                   torch.randint(0, COMPOSED_IMAGE_TOKEN - 10, (4,), generator=generator)]
    input_ids = torch.cat(pieces)[None]
    if not images:
        return input_ids, text_positions(input_ids.shape[1]), None
    whole = model_cfg.vision.image_size // PATCH * PATCH  # a valid convolution never reads the pixels past it
    squares = torch.cat([squares for squares, _ in images])[..., :whole, :whole]  # [n, C, whole, whole]
    rows = torch.from_numpy(patch_rows(squares.contiguous().numpy(), PATCH))  # [n * side^2, C * p * p]
    return input_ids, text_positions(input_ids.shape[1]), rows


def _internvl_sample(model_cfg, hf_model, *, seed: int = 0, text_len: int = 12, photos=()) -> Case:
    """Each photo as its tiles, one (1, side, side) grid and 4 placeholders a tile."""
    vis = model_cfg.vision
    tiles = [_internvl_tiles(path, vis.image_size) for path in photos]
    per_tile = tokens_per_tile(vis.image_size, vis.patch_size)
    input_ids, positions, rows = _composed_case(model_cfg, seed, text_len,
                                                [(t, t.shape[0] * per_tile) for t in tiles])
    if not tiles:
        return Case(ours=dict(input_ids=input_ids, position_ids=positions), theirs=dict(input_ids=input_ids))
    side = vis.image_size // vis.patch_size
    pixels = torch.cat(tiles)  # [tiles, 3, S, S]
    grids = torch.tensor([[1, side, side]] * pixels.shape[0])
    return Case(ours=dict(input_ids=input_ids, position_ids=positions,
                          media=MediaBatch.of(pixel_values=rows, image_grid_thw=grids)),
                theirs=dict(input_ids=input_ids, pixel_values=pixels))


def _llava_onevision_sample(model_cfg, hf_model, *, seed: int = 0, text_len: int = 12, photos=()) -> Case:
    """A sample's only photo as its anyres squares (the base image, then the crops); photos sharing a
    sample one padded square each (``batch_num_images`` tells transformers which)."""
    settings = anyres_settings(model_cfg)
    images = [_photo(path) for path in photos]
    side = model_cfg.vision.image_size // model_cfg.vision.patch_size
    if len(images) == 1:
        squares = [torch.from_numpy(anyres_crops(images[0], settings))]  # [1 + crops, 3, S, S]
        tokens = [anyres_tokens(images[0].height, images[0].width, settings, PATCH)]
    else:
        squares = [torch.from_numpy(square_padded(image, settings)) for image in images]  # [1, 3, S, S] each
        tokens = [side * side + 1] * len(images)  # its patches and a newline
    input_ids, positions, rows = _composed_case(model_cfg, seed, text_len, list(zip(squares, tokens)))
    if not images:
        return Case(ours=dict(input_ids=input_ids, position_ids=positions), theirs=dict(input_ids=input_ids))
    sizes = torch.tensor([[image.height, image.width] for image in images])
    grids = torch.tensor([[s.shape[0], side, side] for s in squares])
    stacked = torch.zeros(len(squares), max(s.shape[0] for s in squares), *squares[0].shape[1:])
    for index, image_squares in enumerate(squares):
        stacked[index, :image_squares.shape[0]] = image_squares  # [images, max squares, 3, S, S]
    return Case(ours=dict(input_ids=input_ids, position_ids=positions,
                          media=MediaBatch.of(pixel_values=rows, image_grid_thw=grids, image_sizes=sizes)),
                theirs=dict(input_ids=input_ids, pixel_values=stacked, image_sizes=sizes,
                            batch_num_images=torch.tensor([len(images)])))


def _build_internvl(model_cfg, parallel_cfg, **options):
    return build_internvl(model_cfg, parallel_cfg, **build_options(**options))


def _build_llava_onevision(model_cfg, parallel_cfg, **options):
    return build_llava_onevision(model_cfg, parallel_cfg, **build_options(**options))


# ---------------------------------------------------------------------------------------------------
# LLaVA-OneVision-1.5 (RICE-ViT at native resolution, Qwen3): 1-D RoPE, real photos through its processor
# (Qwen2-VL's smart resize, one frame a temporal patch) at a tiny pixel budget: 640 x 457 -> 8 x 10 patches
# (20 tokens), 480 x 640 -> 10 x 8; a video of random pixels, every frame a temporal patch.
# ---------------------------------------------------------------------------------------------------

OV15_MAX_PIXELS = 28 * 28 * 24
OV15_LAYOUTS = {**COMPOSED_LAYOUTS, "video": dict(videos=((3, 4, 6),))}  # 3 frames, each its own class token


def llava_onevision1_5_model_cfg() -> ModelConfig:
    """RICE-ViT (2 blocks of width 32, 2 heads: 16-wide heads, 4 rotary frequencies a row and a column), Qwen3 at
    Qwen's vocabulary and vision tokens (the folder ``--check-logits`` tokenizes for is the reference's own)."""
    return ModelConfig(
        family="llava_onevision1_5",
        vision=VisionConfig(arch="rice_vit", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                            in_channels=3, patch_size=PATCH, temporal_patch_size=1, window=None, rms_norm_eps=1e-5,
                            hidden_act="gelu", norm="layer"),
        projector=ProjectorConfig(arch="patch_merger", spatial_merge_size=2, hidden_act="gelu", out_hidden_size=64),
        language=LanguageConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                num_query_groups=2, head_dim=16, qk_norm=True, add_qkv_bias=False,
                                vocab_size=151936, rope_theta=1e6, mrope_section=[], tie_word_embeddings=False,
                                architecture="Qwen3ForCausalLM"),
        tokens=TokenIdsConfig(), layer_backend="sdpa")


def llava_onevision1_5_hf_model(model_cfg: ModelConfig, seed: int = 0):
    """transformers' LLaVA-OneVision-1.5 of ``model_cfg``, every parameter drawn at random (the class token and
    its rotary angles included)."""
    import transformers

    config = transformers.AutoConfig.for_model(**get_family("llava_onevision1_5").config_to_hf(model_cfg, "float32"))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomised(transformers.LlavaOnevision15ForConditionalGeneration(config).eval())


def _llava_onevision1_5_sample(model_cfg, hf_model, *, seed: int = 0, text_len: int = 12, photos=(),
                               videos=()) -> Case:
    """Each photo smart-resized (``ImageProcessing.pixels``), then each video (random pixels of its grid: every
    frame a temporal patch), ``t * h * w / 4`` placeholders and 4 tokens after each."""
    images = get_family(model_cfg.family).image_processing(
        model_cfg, dataclasses.replace(DataConfig(), min_pixels=3136, max_pixels=OV15_MAX_PIXELS))
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, COMPOSED_IMAGE_TOKEN - 10, (text_len,), generator=generator)]
    media = {"image": ([], []), "video": ([], [])}
    drawn = [("image", *images.pixels(_photo(path))) for path in photos]
    drawn += [("video", torch.randn(t * h * w, 3 * PATCH**2, generator=generator).numpy(), (t, h, w))
              for t, h, w in videos]
    for kind, pixels, grid in drawn:
        media[kind][0].append(torch.from_numpy(pixels))
        media[kind][1].append(grid)
        token = model_cfg.tokens.image_token_id if kind == "image" else model_cfg.tokens.video_token_id
        pieces += [torch.full((grid[0] * grid[1] * grid[2] // 4,), token),
                   torch.randint(0, COMPOSED_IMAGE_TOKEN - 10, (4,), generator=generator)]
    input_ids = torch.cat(pieces)[None]
    given = {}
    for kind, (pixels_key, grid_key) in (("image", ("pixel_values", "image_grid_thw")),
                                         ("video", ("pixel_values_videos", "video_grid_thw"))):
        if media[kind][0]:
            given.update({pixels_key: torch.cat(media[kind][0]), grid_key: torch.tensor(media[kind][1])})
    ours = dict(input_ids=input_ids, position_ids=text_positions(input_ids.shape[1]))
    if given:
        ours["media"] = MediaBatch.of(**given)
    return Case(ours=ours, theirs=dict(input_ids=input_ids, **given))


def _build_llava_onevision1_5(model_cfg, parallel_cfg, **options):
    return build_llava_onevision1_5(model_cfg, parallel_cfg, **build_options(**options))


# ---------------------------------------------------------------------------------------------------
# ERNIE-4.5-VL: its ViT and resampler, modality-isolated experts, interleaved-pair 3-D RoPE; real photos
# smart-resized by the family's processor within small pixel bounds (tests/models/ernie_helpers.py: the model)
# ---------------------------------------------------------------------------------------------------

ERNIE_PIXELS = DataConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 16)  # up to 16 tokens an image


def _ernie_sample(model_cfg, hf_model, *, seed: int = 0, text_len: int = 12, photos=()) -> Case:
    """Text, then each photo as its start marker, its placeholders and its end marker, then 4 more tokens."""
    family, tokens = get_family(model_cfg.family), model_cfg.tokens
    processing = parts.image_processing(family, model_cfg, ERNIE_PIXELS)
    pixels = [processing.pixels(_photo(path)) for path in photos]
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, ernie.IMAGE_START - 10, (text_len,), generator=generator)]
    for _, (t, h, w) in pixels:
        pieces += [torch.tensor([tokens.vision_start_token_id]), torch.full((t * h * w // 4,), tokens.image_token_id),
                   torch.tensor([tokens.vision_end_token_id]),
                   torch.randint(0, ernie.IMAGE_START - 10, (4,), generator=generator)]
    input_ids = torch.cat(pieces)[None]
    if not pixels:
        return Case(ours=dict(input_ids=input_ids, position_ids=text_positions(input_ids.shape[1])),
                    theirs=dict(input_ids=input_ids))
    rows = torch.from_numpy(np.concatenate([rows for rows, _ in pixels]))
    grids = torch.tensor([list(grid) for _, grid in pixels])
    media = MediaBatch.of(pixel_values=rows, image_grid_thw=grids)
    positions = family.position_ids(model_cfg)(input_ids[0], grids, None, None)[:, None]
    return Case(ours=dict(input_ids=input_ids, position_ids=positions, media=media),
                theirs=family.hf_model_inputs(model_cfg, dict(input_ids=input_ids, media=media)))


def _build_ernie(model_cfg, parallel_cfg, **options):
    return get_family(model_cfg.family).build(model_cfg, parallel_cfg, **build_options(**options))


# ---------------------------------------------------------------------------------------------------
# The text-only family: Qwen2, Qwen3, Llama, Qwen3-MoE (both routers), Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE's decoder,
# DeepSeek-V3 and V2
# ---------------------------------------------------------------------------------------------------


def _build_llm(model_cfg, parallel_cfg, **options):
    return build_llm(model_cfg, parallel_cfg, **build_options(**options))


def _text_sample(model_cfg, hf_model, *, seed: int = 0, text_len: int = 40) -> Case:
    """Token ids below the (unpadded) vocabulary; positions as the data pipeline writes them."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, text_len), generator=generator)
    return Case(ours=dict(input_ids=input_ids, position_ids=text_positions(text_len)),
                theirs=dict(input_ids=input_ids))


def _llm(arch: str) -> Reference:
    # DeepSeek (and GLM-5) split over PP 2 at 4 layers: the dense first layer and a sparse one on each stage.
    return Reference(name=arch, model_cfg=lambda: tiny_llm_cfg(arch),
                     hf_model=lambda cfg: build_hf_llm(arch, num_hidden_layers=cfg.language.num_layers),
                     build=_build_llm, sample=_text_sample,
                     pp2_layers=4 if arch.startswith(("deepseek", "glm")) else None)


# The COCO photo of --check-logits (640 x 229) sized as training sizes it: InternVL's 12 tiles and a thumbnail of
# 56 px, LLaVA-OneVision's base square and its anyres crops of 56 px (packed by the photo's size), the Qwen-VL
# towers' smart-resized patch grid.
REFERENCES = {
    reference.name: reference
    for reference in [
        # Tied embeddings (the preset's); untied ones are Qwen3-VL's, Qwen2's and Llama's.
        Reference(name="qwen2_5_vl", model_cfg=lambda: qwen2_5_vl.tiny_model_cfg(tie=True),
                  hf_model=qwen2_5_vl.build_hf_model, build=_build_qwen2_5_vl, sample=_vlm_sample(qwen2_5_vl),
                  layouts=QWEN2_5_VL_LAYOUTS, preset="qwen2.5vl-tiny", pp2_layers=4),
        # 4 decoder layers over PP 2: both DeepStack layers on the first stage.
        Reference(name="qwen3_vl", model_cfg=qwen3_vl.tiny_model_cfg, hf_model=qwen3_vl.build_hf_model,
                  build=_build_qwen3_vl, sample=_vlm_sample(qwen3_vl), layouts=QWEN3_VL_LAYOUTS,
                  to_hub_style=qwen3_vl_hub_style, pp2_layers=4, photo_grid="patch grid [1, 14, 40]"),
        Reference(name="qwen3_vl_moe", model_cfg=lambda: qwen3_vl.tiny_model_cfg(experts=True),
                  hf_model=qwen3_vl.build_hf_model, build=_build_qwen3_vl, sample=_vlm_sample(qwen3_vl),
                  layouts=QWEN3_VL_LAYOUTS, to_hub_style=qwen3_vl_hub_style, pp2_layers=4,
                  photo_grid="patch grid [1, 14, 40]"),
        # Qwen3.5's logits reach ~12 in --check-logits' preset folder and its recurrence's fp32 summation order moves
        # them by ~1e-5 of that (measured 9.0e-6 of the largest, 1.1e-4 absolute): 3x that, relative and absolute.
        Reference(name="qwen3_5", model_cfg=qwen3_5_model_cfg, hf_model=qwen3_5_hf_model, build=_build_qwen3_5,
                  sample=_vlm_sample(qwen3_vl), layouts=QWEN3_5_LAYOUTS, relative=True,
                  to_hub_style=qwen3_5_hub_style, preset="qwen3.5-tiny", pp2_layers=4,
                  photo_grid="patch grid [1, 14, 40]",
                  two_layer_overrides=("model.language.layer_types=[linear_attention,full_attention]",),
                  check_bound=3e-5, check_atol=5e-4),
        Reference(name="qwen3_5_moe", model_cfg=lambda: qwen3_5_model_cfg(moe=True), hf_model=qwen3_5_hf_model,
                  build=_build_qwen3_5, sample=_vlm_sample(qwen3_vl), layouts=QWEN3_5_LAYOUTS, relative=True,
                  to_hub_style=qwen3_5_hub_style, preset="qwen3.5-moe-tiny", pp2_layers=4),
        Reference(name="internvl", model_cfg=internvl_model_cfg, hf_model=internvl_hf_model, build=_build_internvl,
                  sample=_internvl_sample, layouts=COMPOSED_LAYOUTS, packed_media=("one_image", "two_images"),
                  preset="internvl3.5-tiny", pp2_layers=4, photo_grid="patch grid [13, 4, 4]"),
        # InternVL2.5: the same tower on a Qwen2.5 decoder with dynamic RoPE; its own tokenizer and template.
        Reference(name="internvl2_5", model_cfg=internvl2_5_model_cfg, hf_model=internvl2_5_hf_model,
                  build=_build_internvl, sample=_internvl_sample, layouts=COMPOSED_LAYOUTS,
                  packed_media=("one_image", "two_images"), preset="internvl2.5-tiny", pp2_layers=4,
                  photo_grid="patch grid [13, 4, 4]"),
        # The round trip's folder in shards with an index, as the Hub's are.
        Reference(name="llava_onevision", model_cfg=llava_onevision_model_cfg, hf_model=llava_onevision_hf_model,
                  build=_build_llava_onevision, sample=_llava_onevision_sample, layouts=COMPOSED_LAYOUTS,
                  packed_media=("one_image", "two_images"), preset="llava-onevision-tiny", pp2_layers=4,
                  roundtrip_save=dict(max_shard_size="1MB"), photo_grid="patch grid [7, 4, 4]"),
        Reference(name="llava_onevision1_5", model_cfg=llava_onevision1_5_model_cfg,
                  hf_model=llava_onevision1_5_hf_model, build=_build_llava_onevision1_5,
                  sample=_llava_onevision1_5_sample, layouts=OV15_LAYOUTS, packed_media=("one_image", "video"),
                  to_hub_style=llava_onevision1_5_hub_style, pp2_layers=4, photo_grid="patch grid [1, 16, 46]"),
        *[_llm(arch) for arch in ARCHITECTURES_WITH_MOE],
        # 4 decoder layers over PP 2: the dense first layer and a sparse one on each stage.
        Reference(name="ernie4_5_vl", model_cfg=ernie.tiny_cfg, hf_model=ernie.build_hf, build=_build_ernie,
                  sample=_ernie_sample, layouts=COMPOSED_LAYOUTS, packed_media=("one_image", "two_images"),
                  preset="ernie4.5vl-tiny", pp2_layers=4, photo_grid="patch grid [1, 16, 46]"),
    ]
}

# Where two references prove the same code path in a concern, one runs it and the other names its prover here:
# concern -> reference -> (a reference that runs the concern, or a test of the concern's module; why). The
# concern's module runs ``runs(concern)`` and asserts the table (``assert_proven_once``).
PROVEN_BY: dict[str, dict[str, tuple[str, str]]] = {
    "hf_roundtrip": {
        "qwen3_moe_unnormalised": ("qwen3_moe", "its router's weights are the same tensors"),
        "qwen3_5_moe_text": ("qwen3_next", "the text family's hybrid folder with experts and a gated shared expert "
                             "(measured when run: exact); Qwen3.5's four Gated DeltaNet tensors are qwen3_5's rows "
                             "under the text prefix"),
        "glm_moe_dsa": ("deepseek_v32", "GLM-5's tensors are V3.2's rows (one weight map; the indexer's RoPE layout is "
                        "no tensor); convert itself refuses GLM-5 until its chat format is built"),
    },
    "check_logits": {
        "qwen2_5_vl": ("test_qwen2_5_vl_with_a_photo", "the family's folder in the Hub's key style and flat "
                       "config, in two shards, on the photo and the built-in scene"),
        "qwen2": ("test_tp2_in_two_processes", "the same folder at TP 2 (ChatML's reference)"),
        "qwen3": ("test_a_loongforge_checkpoint_is_checked_through_its_hf_export", "the same folder converted to "
                  "megatron, written back as HF and checked"),
        "qwen3_moe_unnormalised": ("qwen3_moe", "its router's math is test_parity's"),
        "qwen2_moe": ("qwen3_moe", "the text family's folder with routed experts, ChatML's chat (qwen2's) and the "
                      "comparison; its attention biases, unrenormalised router and gated shared expert are "
                      "test_parity's and test_tp_parity's"),
        "deepseek_v2": ("deepseek_v3", "the text family's folder, DeepSeek's chat and the comparison; V2's attention "
                        "and router math are test_parity's and test_tp_parity's"),
        "qwen3_next": ("qwen3_moe", "the text family's folder with routed experts and the comparison (measured when "
                       "run: 1.1e-6); its hybrid layers' math is test_parity's and test_tp_parity's, its key layout "
                       "the round trip's, its chat format test_qwen3_next's"),
        "qwen3_5_moe_text": ("qwen3_moe", "the text family's folder with routed experts and the comparison (measured "
                             "when run: 8.9e-7); its layers' math is test_parity's and test_tp_parity's"),
        "qwen3_vl": ("qwen3_vl_moe", "the family's folder, photo and comparison (the MoE's also proves transformers' "
                     "Auto class resolving the model_type); the dense MLP's math is test_parity's"),
        "qwen3_5_moe": ("qwen3_5", "the family's folder, photo and comparison (the Auto class's resolution of a MoE "
                        "model_type: qwen3_vl_moe); the experts' math and Hub key style are test_parity's"),
        "glm_moe_dsa": ("deepseek_v32", "the sparse-attention folder through the command; GLM-5's interleaved indexer "
                        "RoPE is test_parity's and test_tp_parity's, and the command refuses GLM-5 until its chat "
                        "format is built"),
    },
}


def runs(concern: str) -> list[str]:
    """The references ``concern`` runs: every one that names no prover."""
    return [name for name in REFERENCES if name not in PROVEN_BY[concern]]


def assert_proven_once(concern: str, module_tests: dict) -> None:
    """Every reference runs ``concern`` or names its prover: a reference that runs it, or a test of the concern's
    module (``module_tests``: its globals)."""
    for name, (prover, why) in PROVEN_BY[concern].items():
        assert name in REFERENCES, f"PROVEN_BY[{concern!r}] names {name}, which is no reference"
        assert prover in runs(concern) or (prover.startswith("test_") and callable(module_tests.get(prover))), (
            f"{concern}: {name} is proven by {prover} ({why}), which neither runs {concern} nor is a test of its module")
