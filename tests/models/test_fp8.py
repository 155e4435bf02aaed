"""FP8 GEMMs through ``torch._scaled_mm`` (``models.layers.fp8``): each of a linear's three GEMMs equals the
same product of the quantised-then-dequantised operands (the scales and layouts are right) to fp32
rounding, and stays within FP8's own error of the full-precision product; a model's chosen layers
switch to them (the LM head never)."""

from __future__ import annotations

import json

import pytest
import torch

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.models.layers import fp8
from loongforge.models.layers.fp8 import (
    E4M3,
    E5M2,
    AMAX_FLOOR,
    Fp8Matmul,
    Fp8WeightCache,
    SCALED_MM,
    Fp8Policy,
    apply_fp8,
    check_fp8_backend,
    eligible,
    fp8_choice,
    gemm_tokens,
    gemm_tp,
    quantize,
)
from tests.models.llm_helpers import build_pair, text_positions


def _dequantized(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8, inverse = quantize(tensor, dtype)
    return fp8.float() * inverse


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def test_quantize_maps_the_absolute_maximum_to_the_largest_fp8_value():
    tensor = torch.tensor([[0.5, -3.0], [1.25, 0.0]])
    fp8, inverse = quantize(tensor, E4M3)
    assert float(fp8.float().abs().max()) == torch.finfo(E4M3).max == 448.0
    assert float(inverse) == pytest.approx(3.0 / 448.0)
    zeros, inverse = quantize(torch.zeros(2, 2), E5M2)
    assert not zeros.float().any() and (zeros.float() * inverse == 0).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_tiny_nonzero_amax_quantises_to_finite_values(dtype):
    """Issue 30, 5(d): amax 1e-35 gave scale 57344 / 1e-35 = inf in fp32 and [57344, nan]; the
    floored amax gives finite values whose dequantisation is within the floor of the tensor."""
    tensor = torch.tensor([1e-35, 0.0])
    fp8, inverse = quantize(tensor, dtype)
    dequantised = fp8.float() * inverse
    print(f"\n{dtype}: {tensor.tolist()} -> {fp8.float().tolist()} x {float(inverse):.3g} = {dequantised.tolist()}")
    assert torch.isfinite(fp8.float()).all() and torch.isfinite(inverse)
    assert (dequantised - tensor).abs().max() <= AMAX_FLOOR
    # Through the three GEMMs: a gradient of 1e-35 everywhere is finite gradients, not NaN.
    x = torch.randn(16, 32, requires_grad=True)
    weight = torch.randn(16, 32, requires_grad=True)
    Fp8Matmul.apply(x, weight).backward(torch.full((16, 16), 1e-35))
    assert torch.isfinite(x.grad).all() and torch.isfinite(weight.grad).all()


def test_a_weight_is_quantised_once_per_optimizer_step():
    """Issue 30, 5(e): with an ``Fp8WeightCache`` a weight is quantised at its first GEMM of the step
    and its copy serves the forward and data-gradient GEMMs of every micro-batch (a recomputed
    forward too) until ``weights_changed``; the products are the same as quantising at each GEMM."""
    import loongforge.models.layers.fp8 as fp8

    generator = torch.Generator().manual_seed(4)
    weight = (0.05 * torch.randn(48, 96, generator=generator)).requires_grad_(True)  # [N, K]
    micro_batches = [(torch.randn(32, 96, generator=generator), torch.randn(32, 48, generator=generator))
                     for _ in range(4)]
    weight_shapes = {(48, 96), (96, 48)}  # W, and W^T in the data gradient

    def one_step(cache):
        quantised = []
        original = fp8.quantize
        fp8.quantize = lambda tensor, dtype: (quantised.append(tuple(tensor.shape)), original(tensor, dtype))[1]
        try:
            weight.grad, outputs = None, []
            for x, grad_out in micro_batches:
                x = x.clone().requires_grad_(True)
                y = Fp8Matmul.apply(x, weight, cache)
                y.backward(grad_out)
                outputs.append((y.detach(), x.grad))
        finally:
            fp8.quantize = original
        return sum(shape in weight_shapes for shape in quantised), outputs, weight.grad.clone()

    uncached, uncached_outputs, uncached_grad = one_step(None)
    cache = Fp8WeightCache()
    cached, cached_outputs, cached_grad = one_step(cache)
    print(f"\nweight quantisations in a step of 4 micro-batches: {uncached} per GEMM, {cached} cached")
    assert uncached == 8 and cached == 1 and cache.quantisations == 1
    assert all(torch.equal(a, b) for pair in zip(uncached_outputs, cached_outputs) for a, b in zip(*pair))
    assert torch.equal(cached_grad, uncached_grad)
    # The optimizer steps: the next step quantises the updated weight once again, and uses it.
    with torch.no_grad():
        weight.mul_(2.0)
    cache.weights_changed()
    again, outputs, _ = one_step(cache)
    assert again == 1 and cache.quantisations == 2
    assert torch.equal(outputs[0][0], one_step(None)[1][0][0])


@pytest.mark.parametrize("tokens", [64, 37])  # 37: rows padded to the GEMM's multiple of 16
def test_three_gemms_are_the_products_of_the_quantised_operands(tokens):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 96, generator=generator, requires_grad=True)  # [M, K]
    weight = (0.05 * torch.randn(48, 96, generator=generator)).requires_grad_(True)  # [N, K]
    grad_out = torch.randn(tokens, 48, generator=generator)  # [M, N]
    y = Fp8Matmul.apply(x, weight)
    y.backward(grad_out)

    x_q, w_q, dy_q = _dequantized(x, E4M3), _dequantized(weight, E4M3), _dequantized(grad_out, E5M2)
    assert _relative(y, x_q @ w_q.t()) <= 1e-6
    assert _relative(x.grad, dy_q @ w_q) <= 1e-6
    assert _relative(weight.grad, dy_q.t() @ x_q) <= 1e-6
    # Against full precision: E4M3 keeps 3 mantissa bits, E5M2 2.
    assert _relative(y, x.detach() @ weight.detach().t()) <= 0.05
    assert _relative(x.grad, grad_out @ weight.detach()) <= 0.1
    assert _relative(weight.grad, grad_out.t() @ x.detach()) <= 0.1


def test_only_widths_of_sixteen_are_eligible():
    assert eligible(torch.empty(48, 96)) and not eligible(torch.empty(48, 100)) and not eligible(torch.empty(8, 96))


def _emulated_fp8_impl(input, weight, bias=None, *args, **kwargs):
    """A linear's forward with its operands quantised and dequantised in fp32 (what the FP8 GEMM
    computes), for one process (no TP communication)."""
    tokens = input.reshape(-1, input.shape[-1])
    output = (_dequantized(tokens, E4M3) @ _dequantized(weight, E4M3).t()).reshape(*input.shape[:-1], -1)
    return output if bias is None else output + bias


def test_fp8_layers_of_a_model_run_their_gemms_in_fp8(megatron_world_of_one):
    """``apply_fp8`` on Qwen3 (tiny, fp32): every language linear switches, the LM head does not;
    the logits equal those of the same model with each linear's operands quantised and dequantised
    (to fp32 rounding), and the weights get gradients."""
    _, _, model = build_pair("qwen3")
    input_ids = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(1))
    positions = text_positions(48)
    with torch.no_grad():
        full_precision = model(input_ids=input_ids, position_ids=positions)
    linears = [m for name, m in model.named_modules() if name.endswith(("linear_qkv", "linear_proj", "linear_fc1",
                                                                      "linear_fc2"))]
    originals = [m._forward_impl for m in linears]
    for module in linears:
        module._forward_impl = _emulated_fp8_impl
    with torch.no_grad():
        emulated = model(input_ids=input_ids, position_ids=positions)
    for module, original in zip(linears, originals):
        module._forward_impl = original

    counts = apply_fp8(model, lambda kind: (0, SCALED_MM) if kind.endswith(("qkv", "proj", "fc1", "fc2")) else None)
    assert counts == {"language.fc1": (2, 2), "language.fc2": (2, 2), "language.proj": (2, 2), "language.qkv": (2, 2)}
    assert not getattr(model.language_model.output_layer, "fp8", False)
    logits = model(input_ids=input_ids, position_ids=positions)
    assert _relative(logits, emulated) <= 1e-5
    assert _relative(logits, full_precision) > 1e-3  # FP8 really ran (8 quantised GEMMs: ~9% here)
    logits.float().square().mean().backward()
    qkv = model.language_model.decoder.layers[0].self_attention.linear_qkv
    assert qkv.weight.grad is not None and torch.isfinite(qkv.weight.grad).all() and qkv.weight.grad.abs().sum() > 0


def test_frozen_layers_are_not_counted_as_fp8(megatron_world_of_one):
    """A frozen weight runs bf16 (``_fp8_impl``), so the start-up line must not count it as FP8
    (with training.freeze_vision and fp8=on it listed the frozen tower's linears as FP8)."""
    _, _, model = build_pair("qwen3")
    frozen = model.language_model.decoder.layers[0]
    for param in frozen.parameters():
        param.requires_grad_(False)
    counts = apply_fp8(model, lambda kind: (0, SCALED_MM))
    assert counts == {"language.fc1": (1, 2), "language.fc2": (1, 2), "language.proj": (1, 2), "language.qkv": (1, 2)}
    assert not getattr(frozen.self_attention.linear_qkv, "fp8", False)


def test_a_layer_runs_fp8_from_its_policys_rows_on_counting_each_calls_own(megatron_world_of_one):
    """The policy's threshold is compared with each call's rows (a micro-batch's packed tokens),
    not with an estimate from the preset: 48 tokens under a threshold of 64 run the original GEMMs
    bit for bit, 80 tokens run FP8."""
    _, _, model = build_pair("qwen3")
    generator = torch.Generator().manual_seed(1)
    short, long = (torch.randint(0, 300, (1, tokens), generator=generator) for tokens in (48, 80))
    with torch.no_grad():
        plain = {len(ids[0]): model(input_ids=ids, position_ids=text_positions(ids.shape[1])) for ids in (short, long)}
    counts = apply_fp8(model, lambda kind: (64, SCALED_MM))
    assert counts["language.qkv"] == (2, 2)
    with torch.no_grad():
        fp8_run = {len(ids[0]): model(input_ids=ids, position_ids=text_positions(ids.shape[1])) for ids in (short, long)}
    print(f"48 tokens: relative difference {_relative(fp8_run[48], plain[48]):.1e}; "
          f"80 tokens: {_relative(fp8_run[80], plain[80]):.1e}")
    assert torch.equal(fp8_run[48], plain[48])
    assert _relative(fp8_run[80], plain[80]) > 1e-3


def _policy_file(path, layers: dict) -> str:
    path.write_text(json.dumps({"format": "loongforge-fp8-policy", "version": 1, "device": "NVIDIA H200",
                                "min_speedup": 1.05, "layers": layers}))
    return str(path)


def test_policy_picks_a_layer_kind_from_its_tp_and_token_count(tmp_path):
    policy = Fp8Policy.load(_policy_file(tmp_path / "policy.json", {
        "language.fc1": {"1": {"min_tokens": 2048}, "2": {"min_tokens": 4096}},
        "vision.qkv": {"1": {"min_tokens": None}}}))
    assert policy.uses_fp8("language.fc1", 1, 2048) and not policy.uses_fp8("language.fc1", 1, 2047)
    assert policy.uses_fp8("language.fc1", 2, 4096) and not policy.uses_fp8("language.fc1", 2, 3000)
    assert not policy.uses_fp8("language.fc1", 4, 10**6)  # not measured at TP 4: bf16
    assert not policy.uses_fp8("vision.qkv", 1, 10**6)  # FP8 never won
    assert not policy.uses_fp8("language.fc2", 1, 10**6)


@pytest.mark.parametrize("text, fragment", [
    ("{", "cannot read the FP8 policy"),
    ('{"format": "other"}', "not an FP8 policy"),
    ('{"format": "loongforge-fp8-policy", "layers": {"language.fc1": {"1": {}}}, "min_speedup": 1.05, "device": "x"}',
     "entry missing or malformed"),
])
def test_a_bad_policy_file_is_one_line_naming_it(tmp_path, text, fragment):
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        Fp8Policy.load(path)
    assert str(info.value).startswith(f"{path}: ") and fragment in str(info.value) and "\n" not in str(info.value)


def test_gemm_rows_and_tp_of_each_layer_kind():
    cfg = load_run_config("qwen3vl-30b-a3b")  # TP 2, expert TP 1, seq 16384, top-8 of 128 experts
    assert gemm_tokens(cfg, "language.qkv") == 16384 and gemm_tp(cfg, "language.qkv") == 2
    assert gemm_tokens(cfg, "language.expert_fc1") == 16384 * 8 // 128 and gemm_tp(cfg, "language.expert_fc1") == 1
    patches = cfg.data.max_pixels // 16**2
    assert gemm_tokens(cfg, "vision.fc1") == patches and gemm_tokens(cfg, "projector.fc1") == patches // 4
    assert gemm_tp(cfg, "vision.fc1") == 2


def test_choice_on_a_machine_without_fp8_gemms(tmp_path):
    cpu = torch.device("cpu")
    assert fp8_choice(load_run_config("qwen2.5vl-7b"), cpu, "sdpa") == (None, "fp8: off")
    decide, line = fp8_choice(load_run_config("qwen2.5vl-7b", overrides=["training.fp8=auto"]), cpu, "sdpa")
    assert decide is None and line == "fp8: auto, but cpu has no FP8 GEMMs (CUDA compute capability 8.9+): bf16 everywhere"
    with pytest.raises(InputError, match=r"^training.fp8=on needs a CUDA GPU with FP8 GEMMs"):
        fp8_choice(load_run_config("qwen2.5vl-7b", overrides=["training.fp8=on"]), cpu, "sdpa")


def test_state_dict_is_unchanged_by_fp8(megatron_world_of_one):
    """Current scaling keeps no FP8 state: checkpoints and ``convert`` see the same weights."""
    _, _, model = build_pair("qwen3")
    def described():  # _extra_state entries are None without Transformer Engine
        return {k: None if v is None else (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}

    before = described()
    apply_fp8(model, lambda kind: (0, SCALED_MM))
    assert described() == before


def _saved_bytes(run) -> tuple[object, int]:
    """(run()'s result, bytes of the tensors autograd saved for backward while it ran)."""
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return result, saved[0]


# The three GEMMs without quantisation: the FP8 path's communication alone.
EXACT_GEMMS = {"forward_gemm": lambda x, w, cache: x @ w.t(),
               "input_gradient_gemm": lambda dy, w, cache, dtype: dy @ w,
               "weight_gradient_gemm": lambda dy, x, w: dy.t() @ x}


def _tp_worker(rank: int, port: int, workdir: str) -> None:
    """TP 2 with and without sequence parallelism: loss, gradients and the bytes saved for backward
    of the unchanged model, of the FP8 path with exact GEMMs in place of the FP8 ones (its
    communication alone), and of real FP8; the same for torchao's tensorwise recipe."""
    from pathlib import Path

    import loongforge.models.layers.fp8 as fp8
    import loongforge.models.layers.fp8_torchao as fp8_torchao
    from loongforge.config.schema import ParallelConfig
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.llm.model import build_model
    from tests.models.helpers import destroy_megatron, init_megatron, limit_threads

    limit_threads()
    init_megatron(rank, 2, port, tp=2)
    case = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for sequence_parallel in (False, True):
        for variant in ("plain", "fp8_path_exact_gemm", "fp8", "torchao_path_exact_gemm", "torchao"):
            parallel_cfg = ParallelConfig(tensor_model_parallel_size=2, world_size=2, sequence_parallel=sequence_parallel)
            model = build_model(case["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                                post_process=True, device="cpu")
            load_hf_state_dict(model, case["hf_state"])
            if variant != "plain":
                apply_fp8(model, lambda kind: (0, "tensorwise" if variant.startswith("torchao") else SCALED_MM))
            gemms = {name: getattr(fp8, name) for name in EXACT_GEMMS}
            float8_matmul = fp8_torchao.float8_matmul
            if variant == "fp8_path_exact_gemm":
                for name, exact in EXACT_GEMMS.items():
                    setattr(fp8, name, exact)
            if variant == "torchao_path_exact_gemm":
                fp8_torchao.float8_matmul = lambda x, weight, recipe: x @ weight.t()
            try:
                loss, saved = _saved_bytes(lambda: model(input_ids=case["input_ids"], position_ids=text_positions(32),
                                                         labels=case["labels"]))
                loss.sum().backward()
            finally:
                for name, gemm in gemms.items():
                    setattr(fp8, name, gemm)
                fp8_torchao.float8_matmul = float8_matmul
            results[(sequence_parallel, variant)] = {
                "loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "saved_bytes": saved}
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def test_tp2_fp8_path_communicates_and_saves_like_megatron(tmp_path):
    """Under TP 2 the FP8 path's communication gives megatron's losses and gradients, and it saves
    the same activations for backward: with sequence parallelism the local input shard, not the
    gathered input (TP times more, before the fix)."""
    from tests.models.helpers import free_port, run_workers
    from tests.models.llm_helpers import build_hf_llm, tiny_llm_cfg

    generator = torch.Generator().manual_seed(3)
    torch.save({"model_cfg": tiny_llm_cfg("qwen3"), "hf_state": build_hf_llm("qwen3").state_dict(),
                "input_ids": torch.randint(0, 300, (1, 32), generator=generator),
                "labels": torch.randint(0, 300, (1, 32), generator=generator)}, tmp_path / "inputs.pt")
    run_workers(_tp_worker, 2, (free_port(), str(tmp_path)), 240)
    results = torch.load(tmp_path / "outputs.pt", weights_only=False)
    for sequence_parallel in (False, True):
        plain = results[(sequence_parallel, "plain")]
        path = results[(sequence_parallel, "fp8_path_exact_gemm")]
        real = results[(sequence_parallel, "fp8")]
        print(f"sequence_parallel={sequence_parallel}: bytes saved for backward, megatron {plain['saved_bytes']}, "
              f"FP8 path {real['saved_bytes']}")
        assert real["saved_bytes"] == plain["saved_bytes"], sequence_parallel
        assert _relative(path["loss"], plain["loss"]) <= 1e-6, sequence_parallel
        for name, grad in plain["grads"].items():
            assert _relative(path["grads"][name], grad) <= 1e-5, (sequence_parallel, name)
        assert 1e-4 < _relative(real["loss"], plain["loss"]) <= 0.1  # real FP8 ran, within its error
        # torchao's recipe: megatron's own mappings around its matmul, the same losses and gradients
        ao_path, ao = results[(sequence_parallel, "torchao_path_exact_gemm")], results[(sequence_parallel, "torchao")]
        print(f"  torchao tensorwise: loss {_relative(ao['loss'], plain['loss']):.1e} from bf16's, bytes saved "
              f"for backward {ao['saved_bytes']} (megatron {plain['saved_bytes']})")
        assert _relative(ao_path["loss"], plain["loss"]) <= 1e-6, sequence_parallel
        for name, grad in plain["grads"].items():
            assert _relative(ao_path["grads"][name], grad) <= 1e-5, (sequence_parallel, name)
        assert 1e-4 < _relative(ao["loss"], plain["loss"]) <= 0.1
        assert all(torch.isfinite(g).all() for g in real["grads"].values())


def test_fp8_on_with_transformer_engine_linears_is_refused_and_auto_trains_bf16_saying_so():
    check_fp8_backend("off", "te")
    check_fp8_backend("auto", "te")
    check_fp8_backend("on", "flash")
    with pytest.raises(InputError, match=r"^training.fp8=on runs on the local linears .* set model.layer_backend=flash.$"):
        check_fp8_backend("on", "te")
    cfg = load_run_config("qwen2.5vl-7b", overrides=["training.fp8=auto"])
    decide, line = fp8_choice(cfg, torch.device("cuda"), "te")  # decided before the device is asked
    print(line)
    assert decide is None
    assert line.startswith("fp8: auto, but the layers are Transformer Engine's") and "bf16 everywhere" in line


def test_a_policy_measured_on_another_device_is_refused(tmp_path, monkeypatch):
    policy = _policy_file(tmp_path / "policy.json", {"language.fc1": {"1": {"min_tokens": 2048}}})  # an H200's
    cfg = load_run_config("qwen2.5vl-7b", overrides=["training.fp8=auto", f"fp8.policy={policy}"])
    monkeypatch.setattr(fp8, "fp8_gemms_available", lambda device: True)
    monkeypatch.setattr(fp8, "device_name", lambda device: "NVIDIA H200")
    decide, line = fp8_choice(cfg, torch.device("cuda"), "flash")
    assert "(measured on NVIDIA H200), each GEMM call by its own rows" in line
    assert cfg.parallel.tensor_model_parallel_size == 2 and decide("language.fc1") is None  # measured at TP 1 only
    at_tp1 = load_run_config("qwen2.5vl-7b", overrides=["training.fp8=auto", f"fp8.policy={policy}",
                                                        "parallel.tensor_model_parallel_size=1",
                                                        "parallel.sequence_parallel=false"])
    assert fp8_choice(at_tp1, torch.device("cuda"), "flash")[0]("language.fc1") == (2048, SCALED_MM)  # no recipe: scaled_mm
    monkeypatch.setattr(fp8, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(InputError) as refused:
        fp8_choice(cfg, torch.device("cuda"), "flash")
    print(refused.value)
    assert str(refused.value) == (f"fp8.policy={policy} was measured on NVIDIA H200 and this run's device is "
                                  "NVIDIA A100-SXM4-80GB: measure a policy here with loongforge bench gemm (or set "
                                  "training.fp8=off).")


def test_no_tokens_is_an_empty_product():
    """An expert that no token was routed to in a micro-batch: empty output, zero weight gradient."""
    x = torch.zeros(0, 32, requires_grad=True)
    weight = torch.randn(16, 32, requires_grad=True)
    y = Fp8Matmul.apply(x, weight)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 32) and not weight.grad.any()
