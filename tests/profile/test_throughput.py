"""TFLOP/s per GPU and MFU: the formula, the device table, and what the log line and metrics.jsonl
show for a fixed step time and FLOP count."""

from __future__ import annotations

import json

import pytest

from loongforge.config.loader import load_run_config
from loongforge.profile.throughput import Throughput, device_peak_tflops, run_dtype
from loongforge.train.metrics import METRICS_FILE, RunLogger, StepMetrics, format_log_line


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
    assert "| 400 TFLOP/s/GPU | MFU 40.4% | encoder 25% of FLOPs | FLOPs max/mean 1.062" in line
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
    assert "| 1 TFLOP/s/GPU | MFU n/a | encoder 0% of FLOPs" in format_log_line(metrics, 10)
    assert "max/mean" not in format_log_line(metrics, 10)  # one replica: no imbalance to show
