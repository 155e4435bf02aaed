"""torchao's float8 recipes as loongforge drives them (``models.layers.fp8_torchao``) and the per-GEMM
policy choosing among the recipes (``bench.gemm.choose_recipe``), each against a reference written here
from its definition: a scale is the format's largest finite value over the operand's absolute maximum
(floored at 1e-12), per tensor or per row along the GEMM's contraction, rounded down to a power of two
in the rowwise recipe; no amax history; the policy takes, per layer kind, the recipe and threshold
that make the measured counts fastest with FP8 only where it measured at least ``min_speedup`` times
faster. No emulated FP8 matmul is timed or trusted for numerics here (the CPU has no FP8 GEMMs); one
test checks only that a megatron linear routes through torchao's own autograd function."""

from __future__ import annotations

import math
import random

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear
from torchao.float8.float8_linear import Float8Linear  # the test extra installs loongforge[fp8]

from loongforge.bench.gemm import LinearShape, choose_recipe, time_linear, torchao_recipes_to_time
from loongforge.bench.gemm_linear import WholeLinear, time_layer
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.models.layers import fp8
from loongforge.models.layers.fp8 import RECIPES, SCALED_MM, fp8_choice, use_fp8
from loongforge.models.layers.fp8_torchao import TORCHAO_RECIPES, operand_scales, recipe_config, recipe_matmul


# The formats' largest finite values from their definitions: E4M3 (no infinities, one NaN pattern)
# 1.75 * 2^8; E5M2 (IEEE-like) 1.75 * 2^15.
FORMAT_MAX = {torch.float8_e4m3fn: 1.75 * 2 ** 8, torch.float8_e5m2: 1.75 * 2 ** 15}
FLOOR = 1e-12


def _reference_scales(tensor: torch.Tensor, dtype: torch.dtype, per_row: bool, power_of_2: bool) -> torch.Tensor:
    """[rows, 1] (per row) or [1, 1]: FORMAT_MAX / max(amax, FLOOR), in float64 then float32."""
    values = tensor.double().abs()
    amax = values.amax(dim=1, keepdim=True) if per_row else values.max().reshape(1, 1)
    scale = (FORMAT_MAX[dtype] / amax.clamp(min=FLOOR)).float()
    if power_of_2:
        scale = torch.tensor([[2.0 ** math.floor(math.log2(s))] for s in scale.flatten().tolist()])
    return scale


def _weight_and_input():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=generator, dtype=torch.bfloat16) * 0.05  # [N, K]
    weight[3] = 0  # an all-zero output row: its scale comes from the floor, not a division by 0
    weight[5] = 1e-30  # a tiny row: the floor again (the scale would be inf, its zeros NaN)
    weight[7, 2] = 9.0  # the row (and tensor) that sets the amax
    x = torch.randn(32, 48, generator=generator, dtype=torch.bfloat16)  # [M, K]
    x[0] = 0
    return weight, x


def test_the_recipes_scale_dynamically_from_the_formats_maximum():
    """Every operand of both recipes is scaled from its own current amax (no delayed scaling: no
    amax history exists to be kept or checkpointed); tensorwise puts gradients in E5M2 and rounds
    no scale, rowwise keeps E4M3 throughout and rounds every scale down to a power of two."""
    for recipe in TORCHAO_RECIPES:
        config = recipe_config(recipe)
        casts = [config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output,
                 config.cast_config_input_for_grad_weight, config.cast_config_weight_for_grad_input,
                 config.cast_config_grad_output_for_grad_weight]
        assert {c.scaling_type.value for c in casts} == {"dynamic"}
        assert {float(torch.finfo(c.target_dtype).max) for c in casts} <= set(FORMAT_MAX.values())
        assert config.round_scales_to_power_of_2 == (recipe == "rowwise")
    assert recipe_config("tensorwise").cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert {c.scaling_granularity.value for c in [recipe_config("rowwise").cast_config_input]} == {"axiswise"}


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_scales_equal_the_definition_on_each_tp_shard(recipe):
    """The scales of the forward GEMM's operands, on the whole weight and on each TP 2 shard (column-
    parallel: rows split, row-parallel: columns split): each shard is scaled from its own values."""
    weight, x = _weight_and_input()
    per_row, power_of_2 = recipe == "rowwise", recipe == "rowwise"
    shards = [weight, *weight.chunk(2, dim=0), *weight.chunk(2, dim=1)]
    worst = 0.0
    for shard in shards:
        x_part = x[:, : shard.shape[1]]
        x_scale, weight_scale = operand_scales(x_part, shard, recipe)
        expected_x = _reference_scales(x_part, torch.float8_e4m3fn, per_row, power_of_2)
        expected_w = _reference_scales(shard, torch.float8_e4m3fn, per_row, power_of_2)
        assert x_scale.shape == expected_x.shape and weight_scale.shape == expected_w.shape
        for actual, expected in ((x_scale, expected_x), (weight_scale, expected_w)):
            worst = max(worst, float(((actual - expected).abs() / expected).max()))
    print(f"{recipe}: worst relative scale difference from the definition {worst:.1e}")
    assert worst == 0.0  # the same float64 division, then float32 (and the same power of two)
    whole_w = operand_scales(x, weight, recipe)[1]
    if per_row:  # the floor: zero and tiny rows get E4M3 max / 1e-12, rounded down to 2^38
        assert whole_w[3].item() == whole_w[5].item() == 2.0 ** math.floor(math.log2(448 / FLOOR))
    else:  # one scale for the tensor: its largest value 9.0 maps to 448
        assert whole_w.item() == pytest.approx(448 / 9.0, rel=1e-6)
    column_shards = [operand_scales(x, part, recipe)[1] for part in weight.chunk(2, dim=0)]
    if per_row:  # a column-parallel shard holds whole output rows: its rows' scales are the whole weight's
        assert torch.equal(torch.cat(column_shards), whole_w)
    else:  # the shard without the 9.0 is scaled from its own (smaller) amax
        assert column_shards[1].item() > column_shards[0].item() == whole_w.item()


def _reference_choice(timings: list[dict], min_speedup: float) -> tuple:
    """From the definition: every (recipe, threshold) whose FP8 is at least min_speedup faster at the
    threshold and every larger count, FP8 from it and bf16 below; the least total, ties to the
    earlier recipe; (None, None) when bf16 everywhere is as fast."""
    counts = sorted(t["tokens"] for t in timings)
    best = (sum(t["bf16_ms"] for t in timings), len(RECIPES), None, None)
    for index, recipe in enumerate(RECIPES):
        key = "fp8_ms" if recipe == SCALED_MM else f"{recipe}_ms"
        for threshold in counts:
            used = [t for t in timings if t["tokens"] >= threshold]
            if any(t["bf16_ms"] / t[key] < min_speedup for t in used):
                continue
            total = sum(t[key] if t["tokens"] >= threshold else t["bf16_ms"] for t in timings)
            if (total, index) < best[:2]:
                best = (total, index, recipe, threshold)
    return best[2], best[3]


def test_the_policy_picks_the_recipe_and_threshold_the_definition_picks_and_is_never_slower_than_bf16():
    rng = random.Random(0)
    counts = [128, 256, 512, 1024, 2048, 4096]
    cases, chose = 300, {recipe: 0 for recipe in (*RECIPES, None)}
    for _ in range(cases):
        timings = []
        for tokens in counts:
            bf16 = tokens * rng.uniform(0.8, 1.2) / 1000
            # FP8 pays more with more rows: a fixed cost (quantisation, launches) over a cheaper GEMM
            timings.append({"tokens": tokens, "bf16_ms": bf16, **{
                ("fp8_ms" if recipe == SCALED_MM else f"{recipe}_ms"):
                    rng.uniform(0.05, 0.4) + bf16 * rng.uniform(0.4, 1.1) for recipe in RECIPES}})
        recipe, threshold = choose_recipe(timings, 1.05)
        assert (recipe, threshold) == _reference_choice(timings, 1.05)
        chose[recipe] += 1
        for t in timings:  # never slower than bf16 at a measured count
            if recipe is not None and t["tokens"] >= threshold:
                key = "fp8_ms" if recipe == SCALED_MM else f"{recipe}_ms"
                assert t[key] * 1.05 <= t["bf16_ms"]
    print(f"choices over {cases} random timing sets: {chose}")
    assert all(chose.values())  # every recipe, and bf16 everywhere, was the right answer somewhere


def test_a_recipe_not_measured_at_every_count_is_not_chosen():
    timings = [{"tokens": 128, "bf16_ms": 1.0, "fp8_ms": 2.0, "tensorwise_ms": 0.5},
               {"tokens": 256, "bf16_ms": 2.0, "fp8_ms": 3.0}]  # tensorwise missing at 256
    assert choose_recipe(timings, 1.05) == (None, None)
    assert choose_recipe([], 1.05) == (None, None)


def test_the_cpu_bench_says_torchao_was_not_measured():
    recipes, line = torchao_recipes_to_time(torch.device("cpu"))
    print(line)
    assert recipes == () and line.startswith("torchao float8 (tensorwise, rowwise) not measured: cpu has no FP8 GEMMs")


def test_fp8_on_and_a_policy_pick_torchao_recipes(tmp_path, monkeypatch):
    monkeypatch.setattr(fp8, "fp8_gemms_available", lambda device: True)
    monkeypatch.setattr(fp8, "device_name", lambda device: "NVIDIA H200")
    cuda = torch.device("cuda")
    on = load_run_config("qwen2.5vl-7b", overrides=["training.fp8=on"])
    decide, line = fp8_choice(on, cuda, "flash")
    assert decide("language.fc1") == (0, "tensorwise") and line.startswith("fp8: on, tensorwise")
    rowwise = load_run_config("qwen2.5vl-7b", overrides=["training.fp8=on", "fp8.recipe=rowwise"])
    assert fp8_choice(rowwise, cuda, "flash")[0]("vision.qkv") == (0, "rowwise")
    path = tmp_path / "policy.json"
    path.write_text('{"format": "loongforge-fp8-policy", "version": 1, "device": "NVIDIA H200", "min_speedup": 1.05, '
                    '"layers": {"language.fc1": {"2": {"min_tokens": 1024, "recipe": "rowwise"}}}}')
    auto = load_run_config("qwen2.5vl-7b", overrides=["training.fp8=auto", f"fp8.policy={path}"])
    assert fp8_choice(auto, cuda, "flash")[0]("language.fc1") == (1024, "rowwise")
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)  # a machine without the fp8 extra
    assert fp8_choice(on, cuda, "flash")[0]("language.fc1") == (0, SCALED_MM)
    for cfg, key in ((rowwise, "fp8.recipe=rowwise"), (auto, f"fp8.policy={path}")):
        with pytest.raises(InputError, match=rf"^{key} .*torchao does not import here: pip install 'loongforge\[fp8\]'"):
            fp8_choice(cfg, cuda, "flash")


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_a_megatron_linear_routes_through_torchaos_float8_function(megatron_world_of_one, recipe):
    """Routing only: the layer's output and gradients are those of torchao's own ``Float8Linear`` on
    the same weight (bitwise), and no FP8 state enters the state dict."""
    config = ModelParallelConfig(params_dtype=torch.bfloat16, use_cpu_initialization=True)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(48, 64, config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
                                 gather_output=False, skip_bias_add=True)
    keys = set(layer.state_dict())
    assert use_fp8(layer, recipe=recipe) and layer.fp8 == recipe and set(layer.state_dict()) == keys
    reference = torch.nn.Linear(48, 64, bias=False, dtype=torch.bfloat16)
    reference.weight = torch.nn.Parameter(layer.weight.detach().clone())
    reference = Float8Linear.from_float(reference, config=recipe_config(recipe))
    x = torch.randn(32, 1, 48, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(32, 1, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out, _ = layer(xs[0])
    out.backward(grad)
    expected = reference(xs[1])
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(layer.weight.grad if layer.weight.grad is not None else layer.weight.main_grad,
                       reference.weight.grad)


def test_the_gpu_timing_paths_carry_each_recipe(megatron_world_of_one):
    """Plumbing only (what ``bench gemm`` runs where the device has FP8 GEMMs, asked here on the CPU,
    whose emulated figures mean nothing): the GEMM rows and the whole megatron linear each carry a
    time per torchao recipe, and the whole linear its error, so the policy can choose among them."""
    shape = LinearShape("language.fc1", 1, 32, 16, 16)
    gemms = time_linear(shape, 16, device=torch.device("cpu"), steps=1, warmup=0, recipes=TORCHAO_RECIPES)
    layer = WholeLinear("language.fc1", 1, 32, 16, column=True, sequence_parallel=False, expert=False)
    whole = time_layer(layer, 16, device=torch.device("cpu"), micro_batches=1, steps=1, warmup=0,
                       recipes=TORCHAO_RECIPES)
    print({k: v for k, v in whole.items() if k.endswith("_error")})
    for recipe in TORCHAO_RECIPES:
        assert gemms[f"{recipe}_ms"] > 0 and whole[f"{recipe}_ms"] > 0
        assert 1e-3 < whole[f"{recipe}_error"] < 0.12  # FP8 ran (not bf16), and ran right
    assert choose_recipe([whole], 1.05)[0] in (*RECIPES, None)


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_the_compiled_matmul_traces_as_one_graph(recipe):
    """What CUDA compiles (``recipe_matmul(recipe, compiled=True)``): dynamo captures the padding, the
    casts and torchao's autograd function in one graph with no break (a break would leave the casts
    eager, unfused, and FP8 slower than bf16), and the traced function (aot_eager: no kernels built)
    gives the eager output bitwise."""
    run = recipe_matmul(recipe, compiled=False)
    x = torch.randn(40, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))  # 40: padded to 48
    weight = torch.randn(48, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(run)(x, weight)
    torch._dynamo.reset()
    print(f"{recipe}: {explained.graph_count} graph(s), {explained.graph_break_count} break(s)")
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert torch.equal(torch.compile(run, backend="aot_eager")(x, weight), run(x, weight))
    torch._dynamo.reset()
