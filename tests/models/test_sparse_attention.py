"""DeepSeek Sparse Attention (``models.decoder.sparse_attention``) beyond the concern tests (logits, packed rows, TP 2,
LoRA, EP and the HF round trip are the ``deepseek_v32`` and ``glm_moe_dsa`` references' there): the top-k cut meets
tied scores in the reference and still breaks them as transformers does; the choice decides the output; every query
keeps min(index_topk, its earlier tokens) keys; outside training the indexer takes and passes no gradient; GLM-5's
indexer rotates pairs; the config section's checks, and GLM-5's shared-top-k layers refused.

The training stages (on ``deepseek-v3.2-tiny-small-vocab`` at 64 tokens, top-8): the indexer's KL and its gradient
equal the definition's; dense warm-up trains the indexers alone (every other weight bit-identical, the LM loss
unchanged: the attention is dense) and their KL falls; in sparse training the LM loss never reaches the indexer and
the indexer's loss reaches nothing else; a packed row's KL is its samples'."""

from __future__ import annotations

import pytest
import torch

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config
from loongforge.config.schema import MLAConfig, SparseAttentionConfig
from loongforge.models.decoder.sparse_attention import (
    LightningIndexer,
    attention_target,
    freeze_for_stage,
    indexer_kl,
    rotate_halves,
    rotate_pairs,
    take_indexer_statistics,
    weighted_indexer_loss,
)
from loongforge.models.layers.attention import PaddedRowParams
from loongforge.models.llm.model import build_model as build_llm
from loongforge.models.registry import check_family_layout, get_family
from loongforge.train.dry_run import build_parallel_plan, format_parallel_plan
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.llm_helpers import text_positions, tiny_hf_config_dict
from tests.models.references import REFERENCES, build_options, reference_logits

REFERENCE = REFERENCES["deepseek_v32"]


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


@pytest.fixture(scope="module")
def pair(world):
    """The reference's models (built once for the module) and its text sample."""
    model_cfg, hf_model, model = REFERENCE.pair()
    return model_cfg, hf_model, model, REFERENCE.sample(model_cfg, hf_model)


def _indexers(model) -> list[LightningIndexer]:
    return [module for module in model.modules() if isinstance(module, LightningIndexer)]


def test_ties_at_the_cut_break_as_transformers_breaks_them(pair, monkeypatch):
    """Keys no indexer head scores above zero tie at 0; where such a tie straddles a query's cut, which of them are
    kept is torch.topk's choice on the row: the logits still equal transformers' (a different choice moves them by
    the dense-vs-sparse gap below)."""
    model_cfg, hf_model, model, case = pair
    straddling = []
    scores = LightningIndexer.scores

    def counting(self, *args):
        table = scores(self, *args)  # [L, L]
        for t in range(self.topk, table.shape[0]):
            ranked = table[t, :t + 1].sort(descending=True).values
            if ranked[self.topk - 1] == ranked[self.topk]:
                straddling.append(t)
        return table

    monkeypatch.setattr(LightningIndexer, "scores", counting)
    with torch.no_grad():
        logits = model(**case.ours)[..., :model_cfg.language.vocab_size]
    diff = float((logits - reference_logits(hf_model, case)).abs().max())
    print(f"\ndeepseek_v32: {len(straddling)} queries with a tie across the top-{model_cfg.language.sparse_attention.index_topk}"
          f" cut (3 layers, {case.length} tokens); logits differ by {diff:.1e}")
    assert straddling and diff <= REFERENCE.tolerance


def test_the_choice_decides_the_output(pair, monkeypatch):
    """Every earlier key kept (index_topk past the prompt) gives other logits: the sparse path is what matched."""
    model_cfg, hf_model, model, case = pair
    for indexer in _indexers(model):
        monkeypatch.setattr(indexer, "topk", case.length)
    with torch.no_grad():
        dense = model(**case.ours)[..., :model_cfg.language.vocab_size]
    gap = float((dense - reference_logits(hf_model, case)).abs().max())
    print(f"\ndeepseek_v32: every key kept vs transformers' top-k: {gap:.2f}")
    assert gap > 1e-2


def test_each_query_keeps_topk_earlier_keys(pair):
    """The mask keeps min(index_topk, t + 1) keys of query t, none after it."""
    _, _, model, _ = pair
    indexer = _indexers(model)[0]
    length, generator = 20, torch.Generator().manual_seed(0)
    x = torch.randn(length, indexer.linear_wk.in_features, generator=generator)
    q_latent = torch.randn(length, indexer.linear_wq_b.in_features, generator=generator)
    angles = torch.randn(length, indexer.rotary // 2, generator=generator).repeat(1, 2)
    keep = indexer.select(x, q_latent, angles.cos(), angles.sin())
    assert not keep.triu(1).any()
    assert keep.sum(-1).tolist() == [min(indexer.topk, t + 1) for t in range(length)]


def test_outside_training_the_indexer_takes_no_gradient(pair):
    """In eval mode (no indexer loss) the LM loss's backward leaves the indexer untouched and reaches the main model:
    the choice passes no gradient."""
    model_cfg, _, model, case = pair
    assert not model.training
    model.zero_grad(set_to_none=True)
    loss = model(**case.ours, labels=case.ours["input_ids"]).sum()
    loss.backward()
    assert all(p.grad is None for indexer in _indexers(model) for p in indexer.parameters())
    assert model.language_model.decoder.layers[0].self_attention.q_layernorm.weight.grad is not None
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("override, expected", [
    ("model.language.sparse_attention.index_head_dim=8", "index_head_dim=8 is below"),
    ("model.language.multi_latent_attention.q_lora_rank=null", "q_lora_rank is not"),
    ("model.language.sparse_attention.index_topk=0", "must be at least 1"),
    ("model.language.sparse_attention=null", "needs model.language.sparse_attention set"),
    ("model.language.sparse_attention.rope_interleaved=true", "DeepseekV32ForCausalLM needs "
     "model.language.sparse_attention set with rope_interleaved: false"),
    ("model.language.sparse_attention.stage=warmup", "stage='warmup' must be one of dense_warmup, sparse"),
    ("model.language.sparse_attention.indexer_loss_coeff=-1", "indexer_loss_coeff=-1.0 must not be negative"),
    ("model.language.sparse_attention.stage=dense_warmup model.language.sparse_attention.indexer_loss_coeff=0",
     "indexer_loss_coeff=0 gives the indexer no loss"),
    ("model.language.sparse_attention.stage=dense_warmup lora.rank=8", "lora.rank=8 freezes every base weight"),
])
def test_the_section_checks_itself(override, expected):
    """Loading checks the section; the family checks the architecture it states (``check_family_layout``)."""
    with pytest.raises(ConfigError, match=expected):
        check_family_layout(load_run_config("deepseek-v3.2-tiny", overrides=override.split()))


def test_context_parallel_is_refused_until_proven():
    problems = SparseAttentionConfig().problems(multi_latent_attention=MLAConfig(), context_parallel=2)
    assert len(problems) == 1 and "parallel.context_parallel_size=2" in problems[0]


def test_glm5s_indexer_rotates_pairs(world, monkeypatch):
    """GLM-5 (``glm_moe_dsa``, whose logits are test_parity's) with DeepSeek-V3.2's halves in its indexer's RoPE chooses
    other keys: the layout is in force."""
    reference = REFERENCES["glm_moe_dsa"]
    model_cfg, hf_model, model = reference.pair()
    case = reference.sample(model_cfg, hf_model)
    assert model_cfg.language.sparse_attention.rope_interleaved
    for indexer in _indexers(model):
        assert indexer.rotate is rotate_pairs
        monkeypatch.setattr(indexer, "rotate", rotate_halves)
    with torch.no_grad():
        halves = model(**case.ours)[..., :model_cfg.language.vocab_size]
    gap = float((halves - reference_logits(hf_model, case)).abs().max())
    print(f"\nglm_moe_dsa: the indexer's RoPE in halves vs transformers' pairs: {gap:.2f}")
    assert gap > 1e-2


def test_glm5_layers_sharing_a_top_k_are_refused():
    """transformers' GLM-5 may let a layer reuse the last full layer's top-k (``indexer_types`` "shared"); loongforge
    builds an indexer in every layer, so such a config.json is refused, and an all-"full" one read."""
    family = get_family("llm")
    for shared in (dict(index_topk_freq=2), dict(indexer_types=["full", "shared", "full"]),
                   dict(index_topk_pattern="FSF")):
        with pytest.raises(InputError, match="reuse another layer's top-k"):
            family.config_from_hf(tiny_hf_config_dict("glm_moe_dsa", **shared), "glm/config.json")
    read = family.config_from_hf(tiny_hf_config_dict("glm_moe_dsa", indexer_types=["full"] * 3), "glm/config.json")
    assert read.language.sparse_attention.rope_interleaved


# The training stages' model: the small-vocabulary preset with rows short enough to check in seconds, and a top-k
# below every sample's length so that the sparse path decides.
STAGE_LENGTH, STAGE_TOPK = 64, 8


def _stage_model(stage: str, **options):
    cfg = load_run_config("deepseek-v3.2-tiny-small-vocab", overrides=[
        f"data.seq_len={STAGE_LENGTH}", f"model.language.sparse_attention.index_topk={STAGE_TOPK}",
        f"model.language.sparse_attention.stage={stage}"])
    torch.manual_seed(0)
    return build_llm(cfg.model, cfg.parallel, **build_options(init_seed=0, **options)).train()


def _tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4000, (1, length), generator=torch.Generator().manual_seed(seed))


def _lm_loss(model, input_ids: torch.Tensor, **packing) -> torch.Tensor:
    positions = packing.pop("position_ids", text_positions(input_ids.shape[1]))
    return model(input_ids=input_ids, position_ids=positions, labels=input_ids, **packing).mean()


def _mean_statistics(model) -> tuple[float, float]:
    """(KL, top-k kept mass), each the mean over the layers, since the last call."""
    totals = take_indexer_statistics([model])
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def _definition_kl(scores: torch.Tensor, query: torch.Tensor, key: torch.Tensor, scale: float,
                   mask: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The mean KL over queries and its gradient with respect to the scores, in float64, query by query from the
    definition: p the heads' softmax over the mask summed and L1-normalised, q the scores' softmax over the mask,
    KL = sum p log(p / q), whose derivative in I[t, s] is q[t, s] - p[t, s] on the mask."""
    length = scores.shape[0]
    total, gradient = 0.0, torch.zeros(length, length, dtype=torch.float64)
    for t in range(length):
        keys = [s for s in range(length) if mask[t, s]]
        p = torch.zeros(len(keys), dtype=torch.float64)
        for head in range(query.shape[1]):
            logits = torch.tensor([float(query[t, head].double() @ key[s, head].double()) * scale for s in keys])
            p += torch.exp(logits - logits.max()) / torch.exp(logits - logits.max()).sum()
        p /= p.sum()
        index = scores[t, keys].double()
        q = torch.exp(index - index.max()) / torch.exp(index - index.max()).sum()
        total += float((p * (p.log() - q.log())).sum())
        gradient[t, keys] = (q - p) / length
    return total / length, gradient


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_the_indexer_kl_and_its_gradient_are_the_definitions(stage):
    """attention_target + indexer_kl (fp32) against the float64 definition on a hand-built attention: 10 queries,
    3 heads, a top-4 mask in the sparse stage (the causal one in warm-up)."""
    length, heads, dim, generator = 10, 3, 8, torch.Generator().manual_seed(1)
    query, key = torch.randn(length, heads, dim, generator=generator), torch.randn(length, heads, dim, generator=generator)
    scores = torch.randn(length, length, generator=generator).masked_fill(
        torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    causal = torch.isfinite(scores)
    chosen = torch.zeros_like(causal).scatter_(-1, scores.topk(4, dim=-1).indices, True) & causal
    mask = causal if stage == "dense_warmup" else chosen
    scores.requires_grad_(True)
    ours = indexer_kl(scores, attention_target(query, key, dim**-0.5, mask), mask).mean()
    ours.backward()
    value, gradient = _definition_kl(scores.detach(), query, key, dim**-0.5, mask)
    value_gap = abs(float(ours) - value)
    gradient_gap = float((scores.grad.double() - gradient).abs().max())
    print(f"\n{stage}: KL {float(ours):.6f}, off the definition's by {value_gap:.1e}; gradient by {gradient_gap:.1e}")
    assert value > 0.05 and value_gap <= 1e-6 and gradient_gap <= 1e-6


def test_dense_warmup_trains_the_indexers_alone(world):
    """30 Adam steps on one 64-token row with every parameter in the optimizer: the indexers' KL falls and their top-k
    keeps more of the attention's mass, every other weight stays bit-identical (no gradient reaches it), and so does
    the LM loss: the attention is dense, whatever the indexers choose. The random model's attention is near uniform
    (a KL of 3e-4 to learn); its query and key up-projections times 3 give the indexers a sharper target."""
    model = _stage_model("dense_warmup")
    assert freeze_for_stage(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".indexer." in name for name in trainable)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("linear_q_up_proj.weight", "linear_kv_up_proj.weight")):
                p.mul_(3.0)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if name not in trainable}
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    input_ids, curve, masses, lm_losses = _tokens(STAGE_LENGTH), [], [], set()
    for _ in range(30):
        optimizer.zero_grad(set_to_none=True)
        loss = _lm_loss(model, input_ids)
        loss.backward()
        optimizer.step()
        lm_losses.add(loss.item())
        kl, mass = _mean_statistics(model)
        curve.append(kl)
        masses.append(mass)
    print(f"\nindexer KL over 30 warm-up steps (every 5th): {' '.join(f'{v:.2e}' for v in curve[::5])} {curve[-1]:.2e}"
          f"\ntop-{STAGE_TOPK} kept mass: {masses[0]:.4f} -> {masses[-1]:.4f}; LM losses seen: {sorted(lm_losses)}")
    assert all(p.grad is None and torch.equal(p, frozen[name]) for name, p in model.named_parameters()
               if name in frozen)
    assert len(lm_losses) == 1
    assert curve[-1] < curve[0] / 5 and masses[-1] > masses[0]


def test_dense_warmup_trains_under_activation_recompute(world):
    """Recompute reruns a layer in the backward only if its input wants a gradient, and a warm-up freezes the
    embedding under layer 0: the indexers' gradients with recompute equal those without (none reached them before
    the warm-up made the embedding's output want one)."""
    gradients = []
    for recompute in (False, True):
        model = _stage_model("dense_warmup", recompute_activations=recompute)
        freeze_for_stage(model)
        _lm_loss(model, _tokens(STAGE_LENGTH)).backward()
        take_indexer_statistics([model])
        gradients.append({name: p.grad for name, p in model.named_parameters() if ".indexer." in name})
    assert all(grad is not None for grad in gradients[1].values())
    gap = max(float((gradients[1][name] - grad).abs().max()) for name, grad in gradients[0].items())
    print(f"\nwarm-up indexer gradients, recompute vs not: {gap:.1e}")
    assert gap <= 1e-9


def test_sparse_training_keeps_the_lm_loss_off_the_indexer(world):
    """Sparse stage, one backward of LM loss + coeff * indexer KL: at coeff 0 (the LM loss alone) every indexer
    gradient is exactly zero; at coeff 1 the indexers get theirs and every other gradient is bit-identical to coeff
    0's: the KL reaches neither the main model's hidden states nor its weights (a missing detach fails one side)."""
    model = _stage_model("sparse")
    assert not freeze_for_stage(model) and all(p.requires_grad for p in model.parameters())
    input_ids, gradients = _tokens(STAGE_LENGTH), {}
    for coeff in (0.0, 1.0):
        model.zero_grad(set_to_none=True)
        with weighted_indexer_loss([model], coeff):
            _lm_loss(model, input_ids).backward()
        gradients[coeff] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    take_indexer_statistics([model])
    indexer = [name for name in gradients[1.0] if ".indexer." in name]
    others = [name for name in gradients[1.0] if ".indexer." not in name]
    assert indexer and set(gradients[0.0]) == set(gradients[1.0])
    lm_reach = max(float(gradients[0.0][name].abs().max()) for name in indexer)
    kl_reach = max(float(gradients[1.0][name].abs().max()) for name in indexer)
    leaked = max(float((gradients[1.0][name] - gradients[0.0][name]).abs().max()) for name in others)
    print(f"\nindexer gradients: LM loss alone {lm_reach:.1e}, with the KL {kl_reach:.1e}; the KL's change to the "
          f"other {len(others)} gradients: {leaked:.1e}")
    assert lm_reach == 0.0 and kl_reach > 0.0 and leaked == 0.0


def test_a_packed_rows_kl_is_its_samples(world):
    """Two samples (40 and 24 tokens) packed in one row with an 8-token padding tail: the row's KL (mean over its
    queries) is the token-weighted mean of each sample's alone, per layer; the tail counts nowhere."""
    model = _stage_model("sparse")
    first, second = _tokens(40, seed=1), _tokens(24, seed=2)
    alone = []
    with torch.enable_grad():
        for sample in (first, second):
            _lm_loss(model, sample)
            alone.append(_mean_statistics(model)[0])
        cu = torch.tensor([0, 40, 64, 72], dtype=torch.int32)
        packing = PaddedRowParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40,
                                  max_seqlen_kv=40, padding_tokens=8)
        positions = torch.cat([torch.arange(40), torch.arange(24), torch.arange(8)]).expand(3, 1, 72)
        row = torch.cat([first, second, torch.zeros(1, 8, dtype=torch.long)], dim=1)
        _lm_loss(model, row, position_ids=positions, packed_seq_params=packing)
    row = _mean_statistics(model)[0]
    expected = (40 * alone[0] + 24 * alone[1]) / 64
    print(f"\npacked row's KL {row:.6e}, its samples' {expected:.6e} ({alone[0]:.3e}, {alone[1]:.3e})")
    assert abs(row - expected) <= 1e-6 * expected


def test_the_dry_run_counts_what_a_warmup_trains():
    """deepseek-v3.2's plan: a warm-up trains its 62 indexers (61 layers and the MTP layer, 13.96M each) and holds
    no gradient or optimizer state for the rest."""
    plans = {stage: format_parallel_plan(build_parallel_plan(load_run_config(
        "deepseek-v3.2", overrides=[f"model.language.sparse_attention.stage={stage}"]))) for stage in ("sparse", "dense_warmup")}
    lines = {stage: {line.split()[0]: line for line in plan.splitlines() if line.strip().startswith(("trainable", "memory"))}
             for stage, plan in plans.items()}
    memory = {stage: float(found["memory"].split("~")[1].split(" GiB")[0]) for stage, found in lines.items()}
    print(f"\n{lines['dense_warmup']['trainable'].strip()}; per rank ~{memory['dense_warmup']} GiB (sparse: "
          f"~{memory['sparse']} GiB)")
    assert "865.48M of 683.50B (sparse_attention.stage=dense_warmup: the indexers)" in lines["dense_warmup"]["trainable"]
    assert "all 683.50B" in lines["sparse"]["trainable"] and memory["dense_warmup"] < memory["sparse"] / 3
