"""The model-FLOP count of every family (``ModelFamily.training_flops``) against what its model executes.

Each family's tiny preset (its small-vocabulary variant: the head's count scales with the vocabulary
either way, and the full one would be 95% of every count) is built on CPU (one process, megatron over
gloo), a packed row of several
samples goes through the data path (synthetic chats and a real video clip, measured, materialised and
collated as training does), and the training step's forward + backward runs under torch's
``FlopCounterMode``. The counted FLOPs, split by the model's parts (vision tower, mergers, decoder
layers, LM head), must equal the analytic count within 2%; ``pytest -s`` prints both.

Gated DeltaNet's rule (Qwen3.5's linear-attention layers) is counted as fla's GPU kernel multiplies it
(``models.decoder.layer_costs.gated_delta_rule_flops``), which no counter sees on CPU: the CPU rule runs unseen and is
charged that count (``FlaCountedRules``); tests/models/test_hybrid_counts.py checks the count against the
plain-torch rule's matmuls.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import (
    FlopCounterMode,
    bmm_flop,
    conv_flop_count,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from loongforge.balance.cost_model import SampleCost
from loongforge.config.loader import load_run_config
from loongforge.config.schema import LinearAttentionConfig
from loongforge.data.collate import collate_row
from loongforge.data.measure import SampleMeasurer, materialize
from loongforge.data.samples import ConversationSample
from loongforge.data.synthetic import SyntheticSamples
from loongforge.data.template import Turn
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models import registry
from loongforge.models.decoder.layer_costs import gated_delta_rule_flops
from loongforge.models.flops import FlopOptions, StepFlops, step_flops
from loongforge.models.decoder.gated_delta_net import GatedDeltaNet
from loongforge.models.towers.qwen2_5_vit.flops import window_sizes
from loongforge.models.towers.qwen2_5_vit.vision import window_partition
from loongforge.profile.features import sample_costs
from loongforge.train.runner import _freeze
from loongforge.train.step import make_forward_step
from tests.data.conftest import LLAMAFACTORY, require
from tests.models.helpers import destroy_megatron, free_port, init_megatron

TOLERANCE = 0.02
VIDEO = LLAMAFACTORY / "mllm_demo_data" / "1.mp4"  # 243 frames at 25 fps, 640x360
# A short, small video so that its sample fits data.seq_len: 4 frames (2 temporal patches) of at
# most 224 x 224 pixels.
VIDEO_OVERRIDES = ["data.video_max_frames=4", "data.video_min_pixels=3136", "data.video_max_pixels=50176"]
# Each case: a packed row of several samples, by kind ("text", "image": one image, "two_images",
# "video"), in row order.
ROWS = {
    "text": ("text", "text", "text"),
    "one_image": ("image", "text", "text"),
    "several_images": ("two_images", "image", "text", "image"),
    "video": ("video", "text", "image"),
}
# The model's parts, by their modules' names in the model.
PARTS = {
    "vision": ("vision_model",),
    "projector": ("projector", "deepstack_projectors"),
    "language": ("language_model.decoder",),
    "lm_head": ("language_model.output_layer",),
}
# Matmuls the convention leaves out: megatron's M-RoPE (Qwen2.5-VL) forms its rotary angles as a
# matmul of the inverse frequencies [3, hd/2, 1] by the positions [3, 1, L], an outer product.
NOT_COUNTED = {"rotary": ("language_model.rotary_pos_emb",)}


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


# ---------------------------------------------------------------------------------------------
# The micro-batch, through the data path
# ---------------------------------------------------------------------------------------------


def _conversations(text_only: bool) -> dict[str, list[ConversationSample]]:
    """Chats by kind, the first few of each kind the synthetic generator makes, and the video clip."""
    found: dict[str, list[ConversationSample]] = {"text": [SyntheticSamples(64, seed=0, text_only=True).get(i)
                                                           for i in range(3)]}
    if text_only:
        return found
    kinds = {1: "image", 2: "two_images"}
    media_samples = SyntheticSamples(64, seed=0)
    for index in range(len(media_samples)):
        sample = media_samples.get(index)
        found.setdefault(kinds.get(len(sample.images), "other"), []).append(sample)
        if len(found.get("image", [])) >= 2 and found.get("two_images"):
            break
    turns = [Turn("user", "<video>What happens in this clip?"), Turn("assistant", "A baby puts on glasses.")]
    found["video"] = [ConversationSample(sample_id=f"{VIDEO}:1", file=str(VIDEO), line=1, turns=turns,
                                         videos=[str(require(VIDEO))])]
    return found


class RowBuilder:
    """Micro-batches of one preset's model, built the way the training pipeline builds them."""

    def __init__(self, cfg):
        self.cfg = cfg
        family = registry.get_family(cfg.model.family)
        chat = family.chat(cfg.model)
        self.measurer = SampleMeasurer(load_tokenizer(cfg.data.tokenizer, chat.jinja_template), cfg.data, cfg.model)
        self.position_ids = family.position_ids(cfg.model)
        self.conversations = _conversations(text_only=not family.has_vision)

    def micro_batch(self, kinds: tuple[str, ...]) -> dict:
        """One packed row of ``kinds``; a kind named twice takes its next chat."""
        chats = [self.conversations[kind][kinds[:position].count(kind)] for position, kind in enumerate(kinds)]
        measured = [self.measurer.measure(chat) for chat in chats]
        rejected = [m for m in measured if not hasattr(m, "input_ids")]
        assert not rejected, rejected
        row = [materialize(m, self.measurer.sizing) for m in measured]
        # No padding: the padding tail would be one more segment of work the samples do not hold.
        return collate_row(row, pad_to_multiple=1, pad_token_id=self.cfg.model.tokens.pad_token_id,
                           position_ids=self.position_ids)

    def samples(self, micro_batch: dict) -> list[SampleCost]:
        return sample_costs(micro_batch)


# ---------------------------------------------------------------------------------------------
# What the model executes
# ---------------------------------------------------------------------------------------------


def build_model(cfg):
    """The preset's model as training builds it (recompute, frozen towers), in fp32 on CPU."""
    model = registry.get_family(cfg.model.family).build(
        cfg.model, cfg.parallel, params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu",
        recompute_activations=cfg.training.recompute_activations, init_seed=cfg.training.seed)
    _freeze(model, cfg)
    return model.train()


class CpuAttentionFormulas:
    """FlopCounterMode formulas for torch's CPU flash-attention kernel, which SDPA runs on CPU (GQA
    and causal included) and torch gives none (its attention would count 0).

    Forward: QK^T and AV over the full square, torch's formula for every SDPA kernel. Backward: the
    gradients, dV and dP (from AV), dQ and dK (from QK^T): 2 x forward. The kernel, like flash-attn,
    also recomputes QK^T from the saved log-sum-exp; torch's formulas for the GPU kernels count that
    too (2.5 x forward), the model-FLOP convention (``models.flops``) does not: it is kept apart here
    in ``score_recompute``, printed, not compared."""

    def __init__(self):
        self.score_recompute = 0

    def forward(self, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(self, grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        batch, heads, q_len, channels = query_shape  # [b, heads, L, hd]
        recompute = bmm_flop((batch * heads, q_len, channels), (batch * heads, channels, key_shape[2]))
        self.score_recompute += recompute
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) - recompute

    def mapping(self) -> dict:
        aten = torch.ops.aten
        return {aten._scaled_dot_product_flash_attention_for_cpu: self.forward,
                aten._scaled_dot_product_flash_attention_for_cpu_backward: self.backward,
                aten.convolution_backward: convolution_backward_flops}


def convolution_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                               _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's backward: its input gradient and its weight gradient multiply what its forward
    does, each. torch's formula agrees for an ungrouped convolution but charges a grouped one's weight
    gradient ``groups`` times over (Gated DeltaNet's depthwise convolution: once per channel)."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


class FlaCountedRules:
    """While active, every Gated DeltaNet layer's rule runs unseen by the counter and charges it what
    fla's kernel multiplies (``gated_delta_rule_flops`` at the layer's shapes): x1 in the forward (again
    under recompute), x2 in the backward, the convention's. The CPU rule is another algorithm (a
    triangular solve where fla multiplies), so counting it would check the wrong kernel."""

    def __init__(self, model, counter: "PartFlopCounter"):
        self.layers = [module for module in model.modules() if isinstance(module, GatedDeltaNet)]
        self.counter = counter

    def __enter__(self):
        for layer in self.layers:
            layer.rule = functools.partial(_FlaCountedRule.apply, layer.rule, self.counter)
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.rule = layer.rule.args[0]


class _FlaCountedRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rule, counter, q, k, v, g, beta, cu_seqlens):
        shape = LinearAttentionConfig(num_key_heads=q.shape[1], num_value_heads=v.shape[1], key_head_dim=q.shape[-1],
                                      value_head_dim=v.shape[-1])
        ctx.flops, ctx.counter = gated_delta_rule_flops(q.shape[0], shape), counter
        ctx.inputs = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v, g, beta)]
        with torch.enable_grad(), _disable_current_modes():
            ctx.out = rule(*ctx.inputs, cu_seqlens)
        counter.charge(ctx.flops)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        wanted = [x for x in ctx.inputs if x.requires_grad]
        with _disable_current_modes():
            grads = iter(torch.autograd.grad(ctx.out, wanted, grad_out, allow_unused=True))
        ctx.counter.charge(2 * ctx.flops)
        return (None, None, *[next(grads) if x.requires_grad else None for x in ctx.inputs], None)


class PartTracker:
    """Which part of the model (``PARTS``) an executing op belongs to.

    FlopCounterMode's own module tracker cannot say in the backward: it sees a module's inputs only
    when they are positional (megatron's blocks take keyword arguments), so a module it entered in
    the backward is never left and later work is charged to it as well. Here, each part's forward
    tags the autograd nodes it created (from its outputs back to its inputs); an op in the backward
    belongs to the part of the node running it. Nodes made in the backward (megatron's reentrant
    checkpoint re-runs a layer and back-propagates through that copy) inherit the part of the last
    tagged node, the checkpoint's own."""

    def __init__(self, model):
        self.node_part: dict = {}
        self.forward_parts: list[str] = []
        self.inputs: list[set] = []
        self.last_backward_part = "other"
        self.handles = []
        for part, names in {**PARTS, **NOT_COUNTED}.items():
            for module in _modules(model, names):
                self.handles += [module.register_forward_pre_hook(self._enter(part), with_kwargs=True),
                                 module.register_forward_hook(self._leave(part), with_kwargs=True)]

    def _enter(self, part: str):
        def hook(module, args, kwargs):
            self.forward_parts.append(part)
            self.inputs.append({t.grad_fn for t in _tensors((args, kwargs)) if t.grad_fn is not None})
        return hook

    def _leave(self, part: str):
        def hook(module, args, kwargs, output):
            self.forward_parts.pop()
            stop = self.inputs.pop()
            pending = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
            while pending:
                node = pending.pop()
                if node is None or node in stop or node in self.node_part:
                    continue
                self.node_part[node] = part
                pending.extend(next_node for next_node, _ in node.next_functions)
        return hook

    def current(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:  # the forward
            return self.forward_parts[-1] if self.forward_parts else "other"
        self.last_backward_part = self.node_part.get(node, self.last_backward_part)
        return self.last_backward_part

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _modules(model, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The modules of ``names`` this model has; a ModuleList's items (the list itself never runs:
    its owner calls the items, as Qwen3-VL calls its DeepStack mergers)."""
    found = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        found += list(module) if isinstance(module, torch.nn.ModuleList) else [module]
    return found


def _tensors(tree) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


class PartFlopCounter(FlopCounterMode):
    """FlopCounterMode that charges every counted op to one part (``PartTracker``)."""

    def __init__(self, tracker: PartTracker, custom_mapping: dict):
        super().__init__(display=False, custom_mapping=custom_mapping)
        self.tracker = tracker
        self.by_part: dict[str, int] = {part: 0 for part in (*PARTS, *NOT_COUNTED, "other")}

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            self.flop_counts["Global"][func_packet] += flops
            self.by_part[self.tracker.current()] += flops
        return out

    def charge(self, flops: int, name: str = "gated_delta_rule") -> None:
        """FLOPs of work that runs unseen (``FlaCountedRules``), to the part running now."""
        self.flop_counts["Global"][name] += flops
        self.by_part[self.tracker.current()] += flops


def counted_flops(model, micro_batch: dict) -> dict[str, float]:
    """FLOPs FlopCounterMode counts in the training step's forward and backward, by part, and in all."""
    forward_step = make_forward_step(torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    attention, tracker = CpuAttentionFormulas(), PartTracker(model)
    try:
        with PartFlopCounter(tracker, attention.mapping()) as counter, FlaCountedRules(model, counter):
            output, loss_function = forward_step(iter([micro_batch]), model)
            loss_sum, _, _ = loss_function(output)
            loss_sum.backward()
    finally:
        tracker.remove()
    counted = {part: float(flops) for part, flops in counter.by_part.items()}
    counted["total"] = float(counter.get_total_flops())
    counted["score_recompute"] = float(attention.score_recompute)
    return counted


def compare(label: str, analytic: StepFlops, counted: dict[str, float]) -> None:
    parts = ", ".join(f"{part} {getattr(analytic, part):.4g}/{counted[part]:.4g}" for part in PARTS)
    largest = max(abs(counted[part] - getattr(analytic, part)) / max(getattr(analytic, part), 1) for part in PARTS)
    print(f"\n{label}: analytic {analytic.total:.6g} counted {counted['total']:.6g} "
          f"({counted['total'] / analytic.total - 1:+.4%}); by part analytic/counted: {parts} (largest "
          f"difference {largest:.4%}); "
          f"not counted: attention kernels' QK^T recompute in backward {counted['score_recompute']:.4g}, "
          f"rotary angles {counted['rotary']:.4g}")
    # Everything executed is in one of the four parts (nothing else runs matmuls), but the rotary
    # angles' outer product: 2 * 3 * hd/2 FLOPs per token.
    assert counted["other"] == 0
    assert counted["rotary"] <= 1e-4 * counted["total"]
    for part in PARTS:
        assert counted[part] == pytest.approx(getattr(analytic, part), rel=TOLERANCE, abs=0), part
    assert counted["total"] == pytest.approx(analytic.total, rel=TOLERANCE)


# ---------------------------------------------------------------------------------------------
# Per family: the four rows
# ---------------------------------------------------------------------------------------------


def _preset(name: str) -> str:
    return f"{registry.get_family(name).tiny_preset}-small-vocab"


def _has_vision(name: str) -> bool:
    return registry.get_family(name).has_vision


def _takes_videos(name: str) -> bool:
    family = registry.get_family(name)
    return bool(family.chat(load_run_config(family.tiny_preset).model).video_block)


# A text-only family reads text rows only; a family whose processor takes images only, no video row.
FAMILY_ROWS = [(name, case) for name in registry.families() for case in ROWS
               if case == "text" or (_has_vision(name) and (case != "video" or _takes_videos(name)))]


@pytest.fixture(scope="module")
def family_run(world, request):
    """(preset config, row builder, model) of one family's tiny preset (``request.param``)."""
    name = request.param
    cfg = load_run_config(_preset(name), overrides=VIDEO_OVERRIDES if _has_vision(name) else [])
    return cfg, RowBuilder(cfg), build_model(cfg)


@pytest.mark.parametrize(("family_run", "case"), FAMILY_ROWS, indirect=["family_run"])
def test_analytic_flops_equal_the_counted_flops(family_run, case):
    cfg, rows, model = family_run
    micro_batch = rows.micro_batch(ROWS[case])
    samples = rows.samples(micro_batch)
    assert len(samples) == len(ROWS[case]) and sum(len(s.grids) for s in samples) == _media_count(ROWS[case])
    analytic = registry.get_family(cfg.model.family).training_flops(cfg.model, samples)
    compare(f"{cfg.preset} {case} (grids {[g for s in samples for g in s.grids]})", analytic,
            counted_flops(model, micro_batch))


def _media_count(kinds: tuple[str, ...]) -> int:
    return sum({"text": 0, "image": 1, "two_images": 2, "video": 1}[kind] for kind in kinds)


# ---------------------------------------------------------------------------------------------
# Training options: recompute, frozen towers; Qwen3's own head_dim; routed experts
# ---------------------------------------------------------------------------------------------

OPTIONS = {
    "recompute": ["training.recompute_activations=true"],
    "freeze_vision": ["training.freeze_vision=true"],
    "freeze_projector": ["training.freeze_projector=true"],
    "freeze_both": ["training.freeze_vision=true", "training.freeze_projector=true"],
    "recompute_freeze_vision": ["training.recompute_activations=true", "training.freeze_vision=true"],
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", [name for name in registry.families() if _has_vision(name)])
def test_training_options_change_the_count_as_they_change_the_work(world, name, option):
    cfg = load_run_config(_preset(name), overrides=OPTIONS[option])
    rows = RowBuilder(cfg)
    micro_batch = rows.micro_batch(ROWS["several_images"])
    options = FlopOptions.from_training(cfg.training)
    analytic = registry.get_family(name).training_flops(cfg.model, rows.samples(micro_batch), options)
    compare(f"{cfg.preset} several_images {option}", analytic, counted_flops(build_model(cfg), micro_batch))


LANGUAGE_VARIANTS = {
    # Qwen3 lets head_dim differ from hidden / heads: 4 heads of 48 (q width 192) on a width of 128.
    "head_dim_48": ("llm-tiny-small-vocab", ["model.language.head_dim=48"]),
    "moe": ("qwen3-moe-tiny-small-vocab", []),
    "moe_recompute": ("qwen3-moe-tiny-small-vocab", ["training.recompute_activations=true"]),
    # Qwen3.5-MoE: hybrid layers, routed experts beside a gated shared expert.
    "hybrid_moe": ("qwen3.5-moe-tiny-small-vocab", []),
    # DeepSeek-V3: multi-latent attention (query and value widths differ), a dense first layer, then sparse
    # ones with an ungated shared expert.
    "latent_moe": ("deepseek-v3-tiny-small-vocab", []),
    # DeepSeek-V3.2: DeepSeek-V3's under sparse attention, the indexer and its KL loss counted beside the layer passes.
    "sparse_latent_moe": ("deepseek-v3.2-tiny-small-vocab", []),
    # MiMo-V2-Flash: full and sliding-window layers (sinks, more key/value heads, values narrower than keys), a
    # dense first layer, then routed experts without a shared expert.
    "sliding_window_moe": ("mimo-tiny-small-vocab", []),
}


@pytest.mark.parametrize("variant", LANGUAGE_VARIANTS)
def test_decoder_variants(world, variant):
    preset, overrides = LANGUAGE_VARIANTS[variant]
    cfg = load_run_config(preset, overrides=overrides)
    rows = RowBuilder(cfg)
    micro_batch = rows.micro_batch(ROWS["text"])
    options = FlopOptions.from_training(cfg.training)
    analytic = registry.get_family(cfg.model.family).training_flops(cfg.model, rows.samples(micro_batch), options)
    compare(f"{preset} text {variant}", analytic, counted_flops(build_model(cfg), micro_batch))


# ---------------------------------------------------------------------------------------------
# The contract without a model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [name for name in registry.families() if _has_vision(name)])
def test_a_vision_family_needs_the_grids(name):
    model_cfg = load_run_config(_preset(name)).model
    with pytest.raises(ValueError, match=r"sample 1 has 1 image\(s\)/video\(s\) \(64 patches\) but no grids.*"
                                         r"profile.features.sample_costs"):
        registry.get_family(name).training_flops(model_cfg, [SampleCost(tokens=8), SampleCost(tokens=30, patches=(64,))])


def test_a_text_family_refuses_media():
    model_cfg = load_run_config(_preset("llm")).model
    with pytest.raises(ValueError, match=r"samples \[0\] carry images or videos, but model.family=llm is text-only"):
        registry.get_family("llm").training_flops(model_cfg, [SampleCost(tokens=30, patches=(64,), grids=((1, 8, 8),))])


def test_step_flops_parts_and_share():
    flops = StepFlops(vision=2.0, projector=1.0, language=5.0, lm_head=2.0)
    assert flops.total == 10.0 and flops.encoder_share == 0.3
    assert flops.to_dict() == {"vision": 2.0, "projector": 1.0, "language": 5.0, "lm_head": 2.0, "total": 10.0,
                               "encoder_share": 0.3}
    assert StepFlops(0.0, 0.0, 0.0, 0.0).encoder_share == 0.0


def test_an_empty_micro_batch_costs_nothing():
    for name in registry.families():
        model_cfg = load_run_config(_preset(name)).model
        assert registry.get_family(name).training_flops(model_cfg, []).total == 0


@pytest.mark.parametrize("grid", [(4, 12), (8, 8), (20, 16), (46, 46), (52, 92)])
def test_window_sizes_match_the_models_window_partition(grid):
    _, cu_seqlens = window_partition(torch.tensor([[1, *grid]]), merge=2, window_units=4)
    assert window_sizes(*grid, merge=2, window_units=4) == (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def test_the_flop_modules_import_no_torch():
    """MFU and plans count without a model: the count's own modules stay torch-free."""
    models = Path(registry.__file__).parent
    files = [models / "flops.py", *(models / name / "flops.py" for name in registry.families()
                                    if (models / name / "flops.py").exists()),
             *(models / "towers").glob("*/flops.py")]
    assert len(files) >= 4
    for path in files:
        imported = [alias.name for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.ImportFrom) and node.module]
        assert not [name for name in imported if name.split(".")[0] in ("torch", "megatron")], path


def test_options_follow_the_training_config():
    training = load_run_config("qwen2.5vl-tiny", overrides=["training.freeze_projector=true"]).training
    assert FlopOptions.from_training(training) == FlopOptions(freeze_projector=True)
    assert dataclasses.is_dataclass(FlopOptions) and FlopOptions.__dataclass_params__.frozen
    training = load_run_config("qwen2.5vl-tiny", overrides=["training.freeze_language=true"]).training
    assert FlopOptions.from_training(training) == FlopOptions(freeze_language=True)


def test_a_frozen_language_model_carries_activation_gradients_alone():
    """training.freeze_language: each decoder layer and the LM head run forward and pass activation
    gradients down to the trained projector: 2 forward-equivalents of 3 (3 of 4 under recompute)."""
    model_cfg = load_run_config("qwen2.5vl-tiny").model
    samples = [SampleCost(tokens=300, loss_tokens=100)]
    trained = step_flops(model_cfg, samples, FlopOptions())
    frozen = step_flops(model_cfg, samples, FlopOptions(freeze_language=True))
    assert frozen.language * 3 == trained.language * 2 and frozen.lm_head * 3 == trained.lm_head * 2
    recomputed = step_flops(model_cfg, samples, FlopOptions(freeze_language=True, recompute=True))
    assert recomputed.language * 4 == step_flops(model_cfg, samples, FlopOptions(recompute=True)).language * 3
