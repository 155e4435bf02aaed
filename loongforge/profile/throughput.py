"""Model FLOPs of a training step, TFLOP/s per GPU, MFU and HFU: the throughput a run reports.

Model FLOPs are what the model's definition costs on the step's real samples (the family's
``training_flops``: the vision encoder and projector on every image and video, the language model
over packed segments, the LM head on loss tokens; padding is not the model's work), forward and
backward, without activation recompute: PaLM's MFU (Chowdhery et al. 2022, appendix B) counts
the model's FLOPs whatever the implementation re-runs. Hardware FLOPs add the recomputed forwards
(``training.recompute_activations``: every transformer layer's forward a second time), what the
GPU executes. TFLOP/s per GPU = the step's model FLOPs over all ranks / step seconds / ranks;
MFU = that / the device's dense peak for the run's dtype (``PEAK_TFLOPS``, ``logging.peak_tflops``
overrides it; unknown devices and the CPU report no MFU unless given); HFU the same with hardware
FLOPs. Without recompute the two are equal; with it HFU / MFU = hardware / model FLOPs (up to 4/3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from loongforge.config.schema import ModelConfig, RunConfig
from loongforge.models.flops import NO_FLOPS, FlopOptions, StepFlops
from loongforge.models.registry import get_family
from loongforge.profile.features import model_sample_costs

# Dense (no sparsity) tensor-core peaks in TFLOP/s, from the vendors' datasheets, by device-name
# fragment (checked in order: the first fragment in the name wins) and dtype.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0}),
    ("H100 NVL", {"bf16": 835.5, "fp8": 1671.0, "tf32": 417.5}),
    ("GH200", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H200", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H800", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H20", {"bf16": 148.0, "fp8": 296.0, "tf32": 74.0}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "tf32": 1100.0}),
    ("L40S", {"bf16": 362.1, "fp8": 733.0, "tf32": 183.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0}),
    ("A800", {"bf16": 312.0, "tf32": 156.0}),
)


def run_dtype(cfg: RunConfig) -> str:
    """The dtype of the run's matmuls that MFU is measured against: fp8 only when every eligible
    linear runs in FP8 (training.fp8=on); fp32 runs use TF32 tensor cores."""
    if cfg.training.fp8 == "on":
        return "fp8"
    return "tf32" if cfg.training.precision == "fp32" else "bf16"


def device_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The table's peak for a device (``torch.cuda.get_device_name()``) and dtype; None if unknown."""
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in device_name:
            return peaks.get(dtype)
    return None


def flop_options(cfg: RunConfig, *, hardware: bool = False) -> FlopOptions:
    """The passes ``cfg``'s run counts: the model's (no recompute: MFU's numerator), or with
    ``hardware`` what runs (the recomputed forwards too: HFU's numerator)."""
    options = FlopOptions.from_training(cfg.training)
    return options if hardware else replace(options, recompute=False)


def micro_batch_flops(micro_batch: dict, model_cfg: ModelConfig, options: FlopOptions) -> StepFlops:
    """Model FLOPs (forward + backward) of one collated micro-batch, from the same per-sample
    description the cost model's features come from (``profile.features.sample_costs``)."""
    return get_family(model_cfg.family).training_flops(model_cfg, model_sample_costs(micro_batch, model_cfg), options)


def steps_flops(micro_batches: list[dict], cfg: RunConfig, *, hardware: bool = False) -> StepFlops:
    """The model FLOPs (``hardware``: the hardware FLOPs) of a rank's micro-batches for this run.
    With data.vision_embeddings the encoder does not run: stored features stand in for it, so it
    counts nothing."""
    options = flop_options(cfg, hardware=hardware)
    flops = sum((micro_batch_flops(mb, cfg.model, options) for mb in micro_batches), NO_FLOPS)
    if cfg.data.vision_embeddings is not None:
        flops = replace(flops, vision=0.0, projector=0.0)
    return flops


@dataclass(frozen=True)
class Throughput:
    """One step's throughput figures."""

    model_flops: float  # the step's model FLOPs over all ranks
    encoder_flops: float  # of which the vision encoder and projector
    step_s: float
    world_size: int
    peak_tflops: Optional[float]  # per GPU, for the run's dtype; None: unknown (no MFU)
    # The step's hardware FLOPs over all ranks (model FLOPs + recomputed forwards); None: no
    # recompute counted, the model FLOPs.
    hardware_flops: Optional[float] = None

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.world_size / 1e12 if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation (PaLM's): model FLOPs per GPU-second over the peak."""
        return self.tflops_per_gpu / self.peak_tflops if self.peak_tflops else None

    @property
    def hardware_tflops_per_gpu(self) -> float:
        flops = self.model_flops if self.hardware_flops is None else self.hardware_flops
        return flops / self.step_s / self.world_size / 1e12 if self.step_s > 0 else 0.0

    @property
    def hfu(self) -> Optional[float]:
        """Hardware FLOPs utilisation: with the recomputed forwards; >= MFU."""
        return self.hardware_tflops_per_gpu / self.peak_tflops if self.peak_tflops else None

    @property
    def encoder_share(self) -> float:
        return self.encoder_flops / self.model_flops if self.model_flops else 0.0
