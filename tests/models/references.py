"""The registry of tiny transformers references: one builder per family (and per variant where the math
differs), each giving what a concern module needs: our config, the transformers model with every
parameter random, our model for a parallel layout, and sample inputs in both forms (ours and
transformers'), text alone or with media (one image, two images, a video, an image and a video) where the
family has media.

A family joins every concern (``test_parity.py``: TP 1; ``test_tp_parity.py``: TP 2 with and without
sequence parallelism) by adding one ``Reference`` to ``REFERENCES``; docs/testing.md says which variant
proves a code path that several share."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.config.loader import load_run_config
from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.llm.model import build_model as build_llm
from loongforge.models.qwen2_5_vl.model import build_model as build_qwen2_5_vl
from loongforge.models.qwen3_5.hf_mapping import to_hub_style as qwen3_5_hub_style
from loongforge.models.qwen3_5.model import build_model as build_qwen3_5
from loongforge.models.qwen3_vl.hf_mapping import to_hub_style as qwen3_vl_hub_style
from loongforge.models.qwen3_vl.model import build_model as build_qwen3_vl
from loongforge.models.registry import get_family
from tests.models import helpers as qwen2_5_vl
from tests.models import test_qwen3_vl_support as qwen3_vl
from tests.models.llm_helpers import ARCHITECTURES_WITH_MOE, build_hf_llm, text_positions, tiny_llm_cfg

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
    relative: bool = False
    tolerance: float = 1e-5
    # transformers' state dict -> the Hub's key style, where our writer (``megatron_to_hf``) writes that style
    to_hub_style: Optional[Callable[[dict], dict]] = None

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
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        present = [case.ours[key] for case in cases if case.ours.get(key) is not None]
        ours[key] = torch.cat(present) if present else None
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
        ours = support.our_inputs(drawn, positions)
        return Case(ours=ours, theirs=dict(ours))
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
# The text-only family: Qwen2, Qwen3, Llama, Qwen3-MoE (both routers), DeepSeek-V3 and V2
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
    return Reference(name=arch, model_cfg=lambda: tiny_llm_cfg(arch), hf_model=lambda _cfg: build_hf_llm(arch),
                     build=_build_llm, sample=_text_sample)


REFERENCES = {
    reference.name: reference
    for reference in [
        # Tied embeddings (the preset's); untied ones are Qwen3-VL's, Qwen2's and Llama's.
        Reference(name="qwen2_5_vl", model_cfg=lambda: qwen2_5_vl.tiny_model_cfg(tie=True),
                  hf_model=qwen2_5_vl.build_hf_model, build=_build_qwen2_5_vl, sample=_vlm_sample(qwen2_5_vl),
                  layouts=QWEN2_5_VL_LAYOUTS),
        Reference(name="qwen3_vl", model_cfg=qwen3_vl.tiny_model_cfg, hf_model=qwen3_vl.build_hf_model,
                  build=_build_qwen3_vl, sample=_vlm_sample(qwen3_vl), layouts=QWEN3_VL_LAYOUTS,
                  to_hub_style=qwen3_vl_hub_style),
        Reference(name="qwen3_vl_moe", model_cfg=lambda: qwen3_vl.tiny_model_cfg(experts=True),
                  hf_model=qwen3_vl.build_hf_model, build=_build_qwen3_vl, sample=_vlm_sample(qwen3_vl),
                  layouts=QWEN3_VL_LAYOUTS, to_hub_style=qwen3_vl_hub_style),
        Reference(name="qwen3_5", model_cfg=qwen3_5_model_cfg, hf_model=qwen3_5_hf_model, build=_build_qwen3_5,
                  sample=_vlm_sample(qwen3_vl), layouts=QWEN3_5_LAYOUTS, relative=True,
                  to_hub_style=qwen3_5_hub_style),
        Reference(name="qwen3_5_moe", model_cfg=lambda: qwen3_5_model_cfg(moe=True), hf_model=qwen3_5_hf_model,
                  build=_build_qwen3_5, sample=_vlm_sample(qwen3_vl), layouts=QWEN3_5_LAYOUTS, relative=True,
                  to_hub_style=qwen3_5_hub_style),
        *[_llm(arch) for arch in ARCHITECTURES_WITH_MOE],
    ]
}
