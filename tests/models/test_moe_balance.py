"""The load-balancing loss: ``RouterStatistics`` of loongforge's Qwen3-MoE give transformers'
``aux_loss`` (``output_router_logits``) and megatron-core's own per-layer losses, each to 1e-6; the
two differ (``models.decoder.moe_balance`` says how). The training step trains it at its coefficient,
and counts the tokens each expert receives."""

import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.models.decoder.moe_balance import (
    RouterStatistics,
    layer_statistics,
    megatron_balance_loss,
    transformers_balance_loss,
)
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.llm.model import build_model
from tests.models.llm_helpers import (
    answer_masked_row,
    build_hf_llm,
    expected_balance_grad,
    router_grad,
    text_positions,
    tiny_llm_cfg,
)

ARCH = "qwen3_moe"


@pytest.fixture
def pair(megatron_world_of_one):
    model_cfg = tiny_llm_cfg(ARCH)
    hf_model = build_hf_llm(ARCH)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu")
    load_hf_state_dict(model, hf_model.state_dict())
    return model_cfg, hf_model, model


def _ids(length: int = 40) -> torch.Tensor:
    return torch.randint(0, 300, (1, length), generator=torch.Generator().manual_seed(5))


def test_statistics_give_transformers_aux_loss(pair):
    model_cfg, hf_model, model = pair
    input_ids = _ids()
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids, output_router_logits=True).aux_loss
        with RouterStatistics(model.eval()).record() as recorded:
            model(input_ids=input_ids, position_ids=text_positions(40))
    assert len(recorded.statistics) == model_cfg.language.num_layers
    assert abs(float(transformers_balance_loss(recorded.statistics)) - float(reference)) <= 1e-6


def test_statistics_give_megatrons_per_layer_losses(pair):
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    model_cfg, _, model = pair
    lang = model_cfg.language
    clear_aux_losses_tracker()
    with RouterStatistics(model.train()).record() as recorded:
        model(input_ids=_ids(), position_ids=text_positions(40))  # training mode, grad on: aux loss
    per_layer = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]  # aux / coeff
    ours = megatron_balance_loss(recorded.statistics, lang.moe.router_topk)
    assert abs(float(per_layer.sum()) - float(ours)) <= 1e-6
    # Not transformers' value: no 1/k there, and its product is over the layer averages.
    assert abs(float(ours) - float(transformers_balance_loss(recorded.statistics))) > 1e-3
    clear_aux_losses_tracker()


@pytest.mark.parametrize("lengths", [(48,), (48, 32, 64, 16)], ids=["one-micro-batch", "four-micro-batches"])
def test_step_trains_the_balance_loss_at_its_coefficient(megatron_world_of_one, lengths):
    """Answer-masked, padded rows (a third of the real tokens carry loss, 8 pad tokens each): the
    balance loss's gradient is the coefficient times the mean of the micro-batches' losses over
    their real tokens, whatever share of tokens carries the language-model loss (megatron-core alone
    divides it by the loss tokens) and however much padding a row has."""
    from megatron.core.transformer.moe.router import TopKRouter

    from loongforge.train.runner import wrap_for_training

    model_cfg = tiny_llm_cfg(ARCH)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu")
    load_hf_state_dict(model, build_hf_llm(ARCH).state_dict())
    chunks, _ = wrap_for_training(model.train(), ParallelConfig())
    router = [m for m in model.modules() if isinstance(m, TopKRouter)][-1]
    micro_batches = [answer_masked_row(length, length // 3, seed, padding=8) for seed, length in enumerate(lengths)]
    coefficient = 0.5
    with_balance, inputs = router_grad(chunks, router, micro_batches, coefficient)
    without_balance, _ = router_grad(chunks, router, micro_batches, 0.0)
    real_inputs = [hidden[:length] for hidden, length in zip(inputs, lengths)]  # [T, 1, h] without padding
    expected = expected_balance_grad(router.weight, real_inputs, model_cfg.language.moe.router_topk, coefficient)
    assert float(expected.abs().max()) > 1e-3  # a gradient worth comparing
    assert (with_balance - without_balance - expected).abs().max() <= 1e-6 * max(1.0, float(expected.abs().max()))


def test_expert_load_counts_each_routed_real_token_once(megatron_world_of_one):
    """``ExpertLoadCounter``: per layer and expert, the real tokens whose top-k chose it over the
    step's training forwards (padding out; a forward without autograd not counted)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from loongforge.models.decoder.moe_balance import ExpertLoadCounter
    from loongforge.train.runner import wrap_for_training

    model_cfg = tiny_llm_cfg(ARCH)
    lang = model_cfg.language
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu")
    load_hf_state_dict(model, build_hf_llm(ARCH).state_dict())
    chunks, _ = wrap_for_training(model.train(), ParallelConfig())
    counter = ExpertLoadCounter(chunks, num_layers=lang.num_layers, num_experts=lang.moe.num_experts,
                                device=torch.device("cpu"))
    lengths = (40, 24)
    rows = [answer_masked_row(length, 8, seed, padding=8) for seed, length in enumerate(lengths)]
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    expected = torch.zeros(lang.num_layers, lang.moe.num_experts)
    inputs = {}
    handles = [r.register_forward_hook(lambda m, a, o, i=i: inputs.setdefault(i, []).append(a[0].detach()))
               for i, r in enumerate(routers)]
    router_grad(chunks, routers[-1], rows, 0.0)
    for handle in handles:
        handle.remove()
    for layer, router in enumerate(routers):
        for hidden, length in zip(inputs[layer], lengths):
            logits = hidden[:length].reshape(length, -1) @ router.weight.detach().t()  # [T, E]
            fractions, _ = layer_statistics(logits, lang.moe.router_topk)
            expected[layer] += fractions * length
    with torch.no_grad():
        model(**{k: v for k, v in rows[0].items() if k in ("input_ids", "position_ids", "padding_mask")})
    load = counter.take()
    assert expected.sum() == sum(lengths) * lang.moe.router_topk * lang.num_layers
    assert (load.tokens_min, load.tokens_max) == (int(expected.min()), int(expected.max()))
    assert abs(load.max_over_mean - float((expected.max(dim=1).values / expected.mean(dim=1)).max())) <= 1e-12
    assert counter.take() is None  # zeroed
    counter.close()
