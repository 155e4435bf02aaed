"""TFLOP/s per GPU, MFU and HFU: the formula, the device table, and what the log line,
metrics.jsonl, TensorBoard and the run's summary show for a fixed step time and FLOP count; with
activation recompute MFU counts the model's FLOPs and HFU the recomputed forwards too."""

from __future__ import annotations

import json

import pytest

from loongforge.config.loader import load_run_config
import torch

from loongforge.models.flops import FlopOptions, decoder_layer_forward_flops
from loongforge.models.registry import get_family
from loongforge.models.towers.qwen2_5_vit.flops import blocks_forward_flops
from loongforge.profile.features import model_sample_costs
from loongforge.profile.throughput import Throughput, device_peak_tflops, run_dtype, steps_flops
from loongforge.models.media import MediaBatch, MediaSet
from loongforge.train.metrics import METRICS_FILE, RunLogger, StepMetrics, format_log_line
from loongforge.train.runner import TrainingSummary, _throughput_text


def test_device_table_picks_the_most_specific_name_and_the_run_dtype():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert device_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert device_peak_tflops("NVIDIA H200", "fp8") == 1978.9
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 tensor cores
    assert device_peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None  # not in the table: MFU n/a
    assert run_dtype(load_run_config("qwen2.5vl-tiny")) == "tf32"  # the tiny preset trains in fp32
    assert run_dtype(load_run_config("qwen2.5vl-7b")) == "bf16"


def _step(throughput: Throughput, model_tflop_by_rank=None) -> StepMetrics:
    return StepMetrics(step=3, loss=1.0, grad_norm=1.0, lr=1e-4, tokens=4096, step_s=throughput.step_s,
                       data_wait_s=0.0, throughput=throughput,
                       by_rank={"model_tflop": model_tflop_by_rank} if model_tflop_by_rank else {})


def test_logged_mfu_is_the_formula(tmp_path):
    # 8 GPUs, 2.0 s, 6.4e15 model FLOPs: 6.4e15 / 2.0 / 8 = 400 TFLOP/s per GPU; 400 / 989.4 = 40.43%.
    throughput = Throughput(model_flops=6.4e15, encoder_flops=1.6e15, step_s=2.0, world_size=8, peak_tflops=989.4)
    assert throughput.tflops_per_gpu == pytest.approx(400.0, rel=1e-12)
    assert throughput.mfu == pytest.approx(400.0 / 989.4, rel=1e-12)
    assert throughput.encoder_share == 0.25
    # Four replicas counted 1.5, 1.7, 1.6 and 1.6 PFLOP: max/mean 1.7 / 1.6.
    metrics = _step(throughput, [1500.0, None, 1700.0, None, 1600.0, None, 1600.0, None])
    line = format_log_line(metrics, 10)
    print(f"\n{line}")
    assert "| 400 TFLOP/s/GPU | MFU 40.4% | HFU 40.4% | encoder 25% of FLOPs | FLOPs max/mean 1.062" in line
    logger = RunLogger(tmp_path, total_steps=10, start_step=2, log_interval=1, enabled=True, tensorboard=False,
                       progress_bar=False)
    logger.log_step(metrics)
    logger.close()
    record = json.loads((tmp_path / METRICS_FILE).read_text())
    assert record["model_tflops_per_gpu"] == pytest.approx(400.0, rel=1e-12)
    assert record["mfu"] == pytest.approx(0.4042854255, rel=1e-9)
    assert record["encoder_flops_share"] == 0.25 and record["flops_max_over_mean"] == pytest.approx(1.0625)
    assert record["model_tflop_by_rank"][0] == 1500.0


def test_without_a_peak_mfu_is_not_a_number_but_na():
    metrics = _step(Throughput(model_flops=1e12, encoder_flops=0.0, step_s=1.0, world_size=1, peak_tflops=None))
    assert "| 1 TFLOP/s/GPU | MFU n/a | HFU n/a | encoder 0% of FLOPs" in format_log_line(metrics, 10)
    assert "max/mean" not in format_log_line(metrics, 10)  # one replica: no imbalance to show


def _micro_batch(cfg) -> dict:
    """Two packed samples (40 and 24 tokens), the first with one 8x8-patch image (16 merged pads)."""
    tokens = cfg.model.tokens
    input_ids = torch.full((1, 64), 7)
    input_ids[0, 4:20] = tokens.image_token_id
    return {"input_ids": input_ids, "sample_lengths": [40, 24], "loss_mask": torch.ones(1, 64),
            "media": MediaBatch(images=MediaSet(grids=torch.tensor([[1, 8, 8]]), samples=(0,)))}


def test_with_recompute_mfu_counts_the_model_and_hfu_the_recomputed_forwards(tmp_path):
    """Issue 30, item 6: with training.recompute_activations=true the model FLOPs (MFU, PaLM's) leave
    out the second forward of every transformer layer, the hardware FLOPs (HFU) count it, and the
    log line, metrics.jsonl, TensorBoard and summary.json show HFU / MFU = hardware / model FLOPs."""
    cfg = load_run_config("qwen2.5vl-tiny-small-vocab", overrides=["training.recompute_activations=true"])
    micro_batches = [_micro_batch(cfg)] * 2
    model, hardware = steps_flops(micro_batches, cfg), steps_flops(micro_batches, cfg, hardware=True)
    samples = model_sample_costs(micro_batches[0], cfg.model)
    training_flops = get_family("qwen2_5_vl").training_flops
    assert model == training_flops(cfg.model, samples, FlopOptions()) + training_flops(cfg.model, samples, FlopOptions())
    # The FLOP model's recompute: one more forward of every vision block and decoder layer.
    recomputed = 2 * (cfg.model.language.num_layers * decoder_layer_forward_flops(cfg.model.language, [40, 24])
                      + blocks_forward_flops(cfg.model, [(1, 8, 8)]))
    assert hardware.total - model.total == recomputed and hardware.lm_head == model.lm_head
    predicted = hardware.total / model.total
    print(f"\nmodel {model.total:.4g} FLOPs, hardware {hardware.total:.4g}: HFU / MFU predicted {predicted:.6f}")
    assert 1 < predicted < 4 / 3

    steps = [Throughput(model_flops=model.total, encoder_flops=model.vision + model.projector, step_s=step_s,
                        world_size=1, peak_tflops=1e-3, hardware_flops=hardware.total) for step_s in (9.0, 2.0, 2.0)]
    t = steps[1]
    assert t.mfu < t.hfu and t.hfu / t.mfu == pytest.approx(predicted, rel=1e-12)
    line = format_log_line(_step(t), 10)
    print(line)
    assert f"| MFU {t.mfu:.1%} | HFU {t.hfu:.1%} |" in line
    logger = RunLogger(tmp_path, total_steps=10, start_step=2, log_interval=1, enabled=True, tensorboard=True,
                       progress_bar=False)
    logger.log_step(_step(t))
    logger.close()
    record = json.loads((tmp_path / METRICS_FILE).read_text())
    assert record["hfu"] / record["mfu"] == pytest.approx(predicted, rel=1e-12)
    assert record["hardware_flops"] == hardware.total and record["model_flops"] == model.total
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/mfu", "train/hfu", "train/hardware_tflops_per_gpu"} <= set(events.Tags()["scalars"])
    # summary.json and the last line: the steps after the first, both utilisations.
    summary = TrainingSummary(start_step=0, end_step=3, throughput=steps)
    means = summary.throughput_means()
    assert means["mfu"] < means["hfu"] and means["hfu"] / means["mfu"] == pytest.approx(predicted, rel=1e-12)
    assert f"MFU {means['mfu']:.1%}, HFU {means['hfu']:.1%}," in _throughput_text(means)
    # Without recompute the two are one number.
    plain = load_run_config("qwen2.5vl-tiny-small-vocab")
    assert steps_flops(micro_batches, plain, hardware=True) == steps_flops(micro_batches, plain) == model
