"""Text-only LLMs' model FLOPs per training step (``FAMILY.training_flops``; convention in
``models.flops``): the shared decoder (dense SwiGLU or routed experts) and the LM head, nothing else.
"""

from __future__ import annotations

from typing import Sequence

from loongforge.balance.cost_model import SampleCost
from loongforge.config.schema import ModelConfig
from loongforge.models.flops import FlopOptions, StepFlops, refuse_media, step_flops
from loongforge.models.llm.hf_config import NAME


def training_flops(model_cfg: ModelConfig, samples: Sequence[SampleCost],
                   options: FlopOptions = FlopOptions()) -> StepFlops:
    """Forward + backward FLOPs of one micro-batch of ``samples`` (packed segments of
    ``sample.tokens``, the LM head on their loss tokens); ``freeze_*`` options freeze nothing here."""
    refuse_media(samples, NAME)
    return step_flops(model_cfg, samples, options)
