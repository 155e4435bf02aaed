"""DeepSeek Sparse Attention (``models.decoder.sparse_attention``) beyond the concern tests (logits, packed rows, TP 2,
LoRA, EP and the HF round trip are the ``deepseek_v32`` and ``glm_moe_dsa`` references' there): the top-k cut meets
tied scores in the reference and still breaks them as transformers does; the choice decides the output; every query
keeps min(index_topk, its earlier tokens) keys; the indexer trains nothing and passes no gradient back; GLM-5's
indexer rotates pairs; the config section's checks, and GLM-5's shared-top-k layers refused."""

from __future__ import annotations

import pytest
import torch

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config
from loongforge.config.schema import MLAConfig, SparseAttentionConfig
from loongforge.models.decoder.sparse_attention import LightningIndexer, rotate_halves, rotate_pairs
from loongforge.models.registry import check_family_layout, get_family
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.llm_helpers import tiny_hf_config_dict
from tests.models.references import REFERENCES, reference_logits

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


def test_the_indexer_is_frozen_and_passes_no_gradient(pair):
    """Nothing trains the indexer yet (its KL loss is a later part) and the main model's gradient does not depend on
    it beyond the keys it chose."""
    model_cfg, _, model, case = pair
    assert all(not p.requires_grad for indexer in _indexers(model) for p in indexer.parameters())
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
])
def test_the_section_checks_itself(override, expected):
    """Loading checks the section; the family checks the architecture it states (``check_family_layout``)."""
    with pytest.raises(ConfigError, match=expected):
        check_family_layout(load_run_config("deepseek-v3.2-tiny", overrides=[override]))


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
