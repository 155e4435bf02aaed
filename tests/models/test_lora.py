"""LoRA adapters (``models.layers.lora``) equal transformers + PEFT: the same adapter weights, read through
``lora_rules`` from PEFT's tensors, give PEFT's logits at TP 1 (Qwen3 text, Qwen2.5-VL with language,
vision and projector adapters), and at TP 2 with and without sequence parallelism the logits and the
adapters' gradients after megatron's gradient finalize (every adapter, written back to PEFT's names
through ``megatron_to_hf``); routed experts' adapters equal their merged weights; an HF folder loads
around new adapters; only the adapters train."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import LoraConfig, OptimizerConfig, ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.layers.lora import adapters, apply_lora, merge_adapters
from loongforge.models.layers.lora_params import lora_rules
from loongforge.models.hf.state_dict_names import is_adapter_key
from tests.models.helpers import (
    build_hf_model,
    destroy_megatron,
    free_port,
    hf_position_ids,
    init_megatron,
    limit_threads,
    make_sample,
    our_inputs,
    run_workers,
    tiny_model_cfg,
)
from tests.models.llm_helpers import answer_masked_row, build_hf_llm, text_positions, tiny_llm_cfg

TOLERANCE = 1e-5
RANK, ALPHA = 4, 8.0
LORA = LoraConfig(rank=RANK, alpha=ALPHA)
ARCH = "qwen3"  # GQA (4 heads, 2 groups): q, k, v rows interleave per group in linear_qkv
LENGTH, LOSS_TOKENS = 32, 12
# PEFT's module names of the decoder's linears (and, in Qwen2.5-VL, the vision blocks' and merger's).
LANGUAGE_TARGETS = r".*layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
VISION_TARGETS = r".*visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate|up|down)_proj)|merger\.mlp\.(0|2))"


def with_random_adapters(hf_model, target_modules: str, seed: int = 3):
    """``hf_model`` wrapped by PEFT with rank-``RANK`` adapters on ``target_modules``, every A and B
    random (B non-zero: a zero B would hide any mistake in A or in B's rows)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_model = get_peft_model(hf_model, PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                         target_modules=target_modules))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return peft_model.eval()


def peft_tensors(peft_model, grads: bool = False) -> dict:
    """PEFT's adapter tensors (or their gradients) by the names PEFT saves them under, less its
    ``base_model.model.`` prefix: the HF names ``lora_rules`` reads."""
    out = {}
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            key = name.removeprefix("base_model.model.").replace(".default.weight", ".weight")
            out[key] = param.grad.clone() if grads else param.detach().clone()
    return out


def _lora_model(build, model_cfg, parallel_cfg, hf_state, peft_state, lora_cfg=LORA):
    """Our model of ``model_cfg`` with the HF base weights and PEFT's adapters."""
    model = build(model_cfg, parallel_cfg, params_dtype=torch.float32, pre_process=True, post_process=True,
                  device="cpu")
    load_hf_state_dict(model, hf_state)
    counts = apply_lora(model, model_cfg, lora_cfg, seed=0)
    load_hf_state_dict(model, peft_state, rules=lora_rules(model_cfg))
    return model, counts


def test_text_logits_match_peft(megatron_world_of_one):
    from loongforge.models.llm.model import build_model

    model_cfg, hf_model = tiny_llm_cfg(ARCH), build_hf_llm(ARCH)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    peft_model = with_random_adapters(hf_model, LANGUAGE_TARGETS)
    model, counts = _lora_model(build_model, model_cfg, ParallelConfig(), hf_state, peft_tensors(peft_model))
    assert counts == {f"language.{kind}": 2 for kind in ("fc1", "fc2", "proj", "qkv")}
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = peft_model(input_ids=input_ids).logits  # [1, s, V]
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            without = base(input_ids=input_ids).logits
        logits = model(input_ids=input_ids, position_ids=text_positions(40))[..., :model_cfg.language.vocab_size]
    error = (logits - reference).abs().max().item()
    print(f"LoRA text logits vs PEFT: {error:.2e} (the adapters move them {(reference - without).abs().max():.2e})")
    assert error <= TOLERANCE
    assert (reference - without).abs().max() > 1000 * TOLERANCE  # the adapters matter
    # B's rows in PEFT's q|k|v order instead of megatron's per-group interleaving: visibly wrong.
    qkv = model.language_model.decoder.layers[0].self_attention.linear_qkv.lora
    prefix = "model.layers.0.self_attn."
    with torch.no_grad():
        qkv.B.copy_(torch.cat([peft_tensors(peft_model)[f"{prefix}{p}_proj.lora_B.weight"] for p in "qkv"]))
        misordered = model(input_ids=input_ids, position_ids=text_positions(40))[..., :model_cfg.language.vocab_size]
    assert (misordered - reference).abs().max() > 100 * TOLERANCE


def test_vision_language_logits_match_peft(megatron_world_of_one):
    """Qwen2.5-VL with adapters in all three towers: the vision blocks' qkv is one HF linear whose
    rows megatron reorders per head, their MLP fuses gate and up; the merger's two linears."""
    from loongforge.models.qwen2_5_vl.model import build_model

    model_cfg = tiny_model_cfg(tie=False)
    hf_model = build_hf_model(model_cfg)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    peft_model = with_random_adapters(hf_model, f"({LANGUAGE_TARGETS})|({VISION_TARGETS})")
    lora_cfg = LoraConfig(rank=RANK, alpha=ALPHA, targets=["language", "vision", "projector"])
    model, counts = _lora_model(build_model, model_cfg, ParallelConfig(), hf_state, peft_tensors(peft_model), lora_cfg)
    assert counts["vision.qkv"] == 2 and counts["projector.fc1"] == 1 and counts["language.fc2"] == 2
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    positions = hf_position_ids(peft_model.get_base_model(), sample)
    with torch.no_grad():
        reference = peft_model(input_ids=sample.input_ids, position_ids=positions, pixel_values=sample.pixel_values,
                               image_grid_thw=sample.image_grid_thw).logits
        logits = model(**our_inputs(sample, positions))
    error = (logits - reference).abs().max().item()
    print(f"LoRA Qwen2.5-VL logits vs PEFT: {error:.2e}")
    assert error <= TOLERANCE
    # The vision qkv's B rows in HF's (q|k|v, head) order instead of megatron's (head, q|k|v).
    qkv = model.vision_model.layers[0].self_attention.linear_qkv.lora
    with torch.no_grad():
        qkv.B.copy_(peft_tensors(peft_model)["model.visual.blocks.0.attn.qkv.lora_B.weight"])
        misordered = model(**our_inputs(sample, positions))
    assert (misordered - reference).abs().max() > 100 * TOLERANCE


def test_a_run_starts_from_an_hf_folder_with_new_adapters(megatron_world_of_one, tmp_path):
    """``checkpoint.load_hf`` fills the base weights of an adapted model (an HF folder has no
    adapters): with B still zero its logits are transformers' own."""
    from loongforge.convert.model_io import load_hf_weights
    from loongforge.models.llm.model import build_model

    model_cfg, hf_model = tiny_llm_cfg(ARCH), build_hf_llm(ARCH)
    hf_model.save_pretrained(tmp_path)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu").eval()
    apply_lora(model, model_cfg, LORA, seed=0)
    load_hf_weights(model, tmp_path)
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids).logits
        logits = model(input_ids=input_ids, position_ids=text_positions(16))[..., :model_cfg.language.vocab_size]
    assert (logits - reference).abs().max() <= TOLERANCE


def test_only_adapters_train(megatron_world_of_one):
    """The base is frozen: megatron's DDP buffers and the optimizer hold the adapters alone, and a
    step changes every adapter and no base weight."""
    from loongforge.models.llm.model import build_model
    from loongforge.train.optim import build_optimizer
    from loongforge.train.runner import wrap_for_training
    from loongforge.train.step import forward_backward

    model_cfg, hf_model = tiny_llm_cfg(ARCH), build_hf_llm(ARCH)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    peft_model = with_random_adapters(hf_model, LANGUAGE_TARGETS)
    model, _ = _lora_model(build_model, model_cfg, ParallelConfig(), hf_state, peft_tensors(peft_model))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and trainable == {name for name, _ in model.named_parameters() if is_adapter_key(name)}
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    chunks, _ = wrap_for_training(model, ParallelConfig())
    optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-2, weight_decay=0.0), params_dtype=torch.float32)
    adapter_numel = sum(model.get_parameter(name).numel() for name in trainable)
    assert sum(buffer.numel_unpadded for buffer in chunks[0].buffers) == adapter_numel
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == adapter_numel
    chunks[0].zero_grad_buffer()
    forward_backward(chunks, [answer_masked_row(LENGTH, LOSS_TOKENS, seed=5)], device=torch.device("cpu"),
                     seq_length=LENGTH, is_loss_rank=True)
    optimizer.step()
    changed = {name for name, param in model.named_parameters() if not torch.equal(param.detach(), before[name])}
    assert changed == trainable


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_expert_adapters_equal_their_merged_weights(arch, megatron_world_of_one):
    """``lora.experts``: every routed expert's fc1 / fc2 gets an adapter (transformers' fused experts
    have no PEFT modules to compare with), which computes what its weight plus ``scaling * B A``
    computes; expert adapters are reduced by megatron's DDP where the experts' weights are. Qwen2-MoE: beside
    a gated shared expert, whose linears take the dense MLP's adapters."""
    from loongforge.models.llm.model import build_model

    model_cfg = tiny_llm_cfg(arch)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True,
                        device="cpu").eval()
    counts = apply_lora(model, model_cfg, LoraConfig(rank=RANK, alpha=ALPHA, experts=True), seed=0)
    experts = model_cfg.language.moe.num_experts * model_cfg.language.num_layers
    shared = {"language.fc1": 2, "language.fc2": 2} if model_cfg.language.moe.shared_expert_ffn_hidden_size else {}
    assert counts == {"language.expert_fc1": experts, "language.expert_fc2": experts, "language.proj": 2,
                      "language.qkv": 2, **shared}  # the shared expert's linears: the dense MLP's fc1 / fc2
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, adapter in adapters(model).items():
            adapter.B.copy_(0.5 * torch.randn(adapter.B.shape, generator=generator))
            assert adapter.A.allreduce == adapter.B.allreduce == model.get_submodule(name).weight.allreduce
    input_ids = torch.randint(0, model_cfg.language.vocab_size, (1, 24), generator=generator)
    with torch.no_grad():
        base_free = model(input_ids=input_ids, position_ids=text_positions(24))
        merge_adapters(model)
        merged = model(input_ids=input_ids, position_ids=text_positions(24))
    error = (merged - base_free).abs().max().item()
    print(f"{arch}: LoRA experts vs merged weights: {error:.2e}")
    assert error <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# TP 2 with sequence parallelism
# ---------------------------------------------------------------------------------------------

WORLD_SIZE = 2
TIMEOUT_S = 240


def _tp_worker(rank: int, port: int, workdir: str) -> None:
    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    case = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    outputs = {sequence_parallel: _tp_logits_and_grads(case, sequence_parallel) for sequence_parallel in (True, False)}
    if rank == 0:
        torch.save(outputs, Path(workdir) / "outputs.pt")
    destroy_megatron()


def _tp_logits_and_grads(case: dict, sequence_parallel: bool) -> dict:
    """The gathered logits [1, s, V] and every rank's adapter gradients (after megatron's finalize)."""
    from loongforge.models.llm.model import build_model
    from loongforge.train.runner import wrap_for_training
    from loongforge.train.step import forward_backward

    parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, sequence_parallel=sequence_parallel,
                                  world_size=WORLD_SIZE)
    model, _ = _lora_model(build_model, case["model_cfg"], parallel_cfg, case["hf_state"], case["peft_state"])
    _assert_checkpoint_shapes(model, case["model_cfg"])
    row = case["row"]
    with torch.no_grad():
        logits = model.eval()(input_ids=row["input_ids"], position_ids=row["position_ids"])  # [1, s, V/2]
    shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
    dist.all_gather(shards, logits.contiguous())
    chunks, _ = wrap_for_training(model.train(), parallel_cfg)
    chunks[0].zero_grad_buffer()
    forward_backward(chunks, [row], device=torch.device("cpu"), seq_length=LENGTH, is_loss_rank=True)
    grads = {name: param.main_grad.clone() for name, param in model.named_parameters() if param.requires_grad}
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, grads)
    return {"logits": torch.cat(shards, dim=-1), "grads": gathered}


def _assert_checkpoint_shapes(model, model_cfg) -> None:
    """The checkpoint describes each TP-split adapter matrix by its whole shape, split along the
    weight's axis (megatron's linear would record one rank's shard as a replicated whole)."""
    from loongforge.models.decoder.layer_costs import head_dim

    lang, layers = model_cfg.language, "language_model.decoder.layers.0."
    qkv_rows = (lang.num_attention_heads + 2 * lang.num_query_groups) * head_dim(lang)
    sharded = model.sharded_state_dict()
    qkv_b, proj_a = sharded[layers + "self_attention.linear_qkv.lora.B"], sharded[layers + "self_attention.linear_proj.lora.A"]
    assert tuple(qkv_b.global_shape) == (lang.num_layers, qkv_rows, RANK)
    assert tuple(proj_a.global_shape) == (lang.num_layers, RANK, lang.num_attention_heads * head_dim(lang))


def test_tp2_logits_and_adapter_grads_match_peft(tmp_path):
    """With and without sequence parallelism: the column-parallel A sees a sequence shard or the
    whole sequence, the row-parallel ``A x`` is reduce-scattered or all-reduced."""
    model_cfg, hf_model = tiny_llm_cfg(ARCH), build_hf_llm(ARCH)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    peft_model = with_random_adapters(hf_model, LANGUAGE_TARGETS)
    row = answer_masked_row(LENGTH, LOSS_TOKENS, seed=5, packed=False)
    torch.save(dict(model_cfg=model_cfg, hf_state=hf_state, peft_state=peft_tensors(peft_model), row=row),
               tmp_path / "inputs.pt")

    run_workers(_tp_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    reference = peft_model(input_ids=row["input_ids"]).logits  # [1, s, V]
    loss_positions = row["loss_mask"][0].bool()
    loss = F.cross_entropy(reference[0][loss_positions], row["labels"][0][loss_positions])  # mean over loss tokens
    loss.backward()
    theirs = peft_tensors(peft_model, grads=True)
    scale = max(grad.abs().max().item() for grad in theirs.values())
    for sequence_parallel, output in outputs.items():
        logits_error = (output["logits"][..., :model_cfg.language.vocab_size] - reference.detach()).abs().max().item()
        ours = megatron_to_hf(output["grads"], model_cfg, rules=lora_rules(model_cfg))
        assert ours.keys() == theirs.keys() and len(ours) == 2 * 7 * model_cfg.language.num_layers
        grad_error = max((ours[key] - theirs[key]).abs().max().item() for key in theirs)
        print(f"LoRA TP2 (sequence parallel {sequence_parallel}) vs PEFT: logits {logits_error:.2e}, adapter grads "
              f"{grad_error:.2e} (largest {scale:.2e})")
        assert logits_error <= TOLERANCE, sequence_parallel
        assert grad_error <= TOLERANCE, sequence_parallel
