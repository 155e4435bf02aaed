"""A step whose last micro-batch holds no image or video, under megatron's DDP with
``overlap_grad_reduce``: the reduction of a gradient bucket starts once every parameter in it has
reported a gradient in the last micro-batch, so an encoder that took no part must still report one
(zero). Without it the step after an image step stops on megatron's "Communication call has not
been issued for this bucket" (or, with the counts learnt from a text-only first step, reduces the
encoder's bucket before its gradients are in).

One process over gloo, with the trainer's DDP settings; three steps: images, text only, images.
"""

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from loongforge.config.schema import ParallelConfig
from loongforge.models.media import MediaBatch
from loongforge.models.registry import get_family
from tests.models.helpers import destroy_megatron, free_port, init_megatron, make_sample, tiny_model_cfg


def _inputs(sample) -> dict:
    seq_len = sample.input_ids.shape[1]
    return dict(
        input_ids=sample.input_ids,
        position_ids=torch.arange(seq_len).expand(3, 1, seq_len).contiguous(),
        labels=sample.input_ids.roll(-1, dims=1),
        media=MediaBatch.of(pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw),
    )


def _encoder_grads(ddp) -> list[torch.Tensor]:
    towers = (ddp.module.vision_model, ddp.module.projector)
    return [param.main_grad.clone() for tower in towers for param in tower.parameters()]


def test_a_text_only_step_reports_zero_encoder_grads_and_does_not_stall():
    model_cfg = tiny_model_cfg()
    init_megatron(0, 1, free_port())
    try:
        model = get_family(model_cfg.family).build(
            model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
            post_process=True, device="cpu", init_seed=7)
        ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True))
        with_image = make_sample(model_cfg, images=((1, 8, 8),), seed=1)
        text_only = make_sample(model_cfg, seed=2)
        for step, sample in enumerate((with_image, text_only, with_image)):
            ddp.zero_grad_buffer()
            ddp(**_inputs(sample)).sum().backward()
            ddp.finish_grad_sync()
            grads = _encoder_grads(ddp)
            if sample is text_only:
                assert all(not grad.any() for grad in grads), f"step {step}: encoder got a gradient"
            else:
                assert any(grad.any() for grad in grads), f"step {step}: encoder got no gradient"
    finally:
        destroy_megatron()
