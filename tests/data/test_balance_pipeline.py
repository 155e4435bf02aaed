"""DataPipeline with balance.enabled: the balanced micro-batches of all ranks together hold exactly
the step's samples; the state (incl. the cost model used) resumes exactly."""

from loongforge.balance.cost_model import TERMS, CostModel
from loongforge.config.schema import BalanceConfig, DataConfig, ModelConfig
from loongforge.data.pipeline import DataPipeline

MODEL = ModelConfig(family="qwen2_5_vl")


def _data():
    return DataConfig(source="synthetic", synthetic_num_samples=60, seq_len=384, num_workers=0, seed=3,
                      max_pixels=12544)


def _pipeline(tokenizer, *, dp_rank, dp_size, balance=True, gbs=4, **kw):
    return DataPipeline(_data(), MODEL, global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size,
                        pad_to_multiple=8, tokenizer=tokenizer,
                        balance_cfg=BalanceConfig(enabled=balance, threshold=0.0), **kw)


class _Owner:
    """What the pipeline reads the cost model from (train.balancing.RunBalancing's interface)."""

    def __init__(self):
        self.cost_model, self.version = None, 0

    def switch(self, model):
        self.cost_model, self.version = model, self.version + 1


def _ids(micro_batches):
    return [sid for mb in micro_batches for sid in mb["sample_ids"]]


def test_balanced_ranks_hold_exactly_the_steps_samples(tokenizer):
    plain = _pipeline(tokenizer, dp_rank=0, dp_size=1, balance=False)
    ranks = [_pipeline(tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    applied = 0
    for _ in range(6):
        expected = _ids(plain.next_step())
        steps = [p.next_step() for p in ranks]
        assert all(len(mbs) == 2 for mbs in steps)  # equal micro-batch count per rank
        assert all(mb["sample_lengths"] for mbs in steps for mb in mbs)
        got = _ids(steps[0]) + _ids(steps[1])
        assert sorted(got) == sorted(expected)  # as a multiset (a step may span two epochs)
        assert sum(sum(mb["sample_lengths"]) <= 384 for mbs in steps for mb in mbs) == 4
        assert ranks[0].last_balance.micro_batches == ranks[1].last_balance.micro_batches
        applied += ranks[0].last_balance.applied
    assert applied > 0
    counters = ranks[0].balance_counters.as_dict()
    assert counters["applied_steps"] == applied
    assert counters["mean_max_over_lb_after"] < counters["mean_max_over_lb_before"]


def _steps(pipeline, n):
    """n steps as (the plan, this rank's sample ids per micro-batch)."""
    steps = []
    for _ in range(n):
        micro_batches = pipeline.next_step()
        steps.append((pipeline.last_balance.micro_batches, [mb["sample_ids"] for mb in micro_batches]))
    return steps


def test_state_resumes_with_the_cost_model_used(tokenizer):
    # Each rank, resumed from its state, re-makes the plans and hands out the same samples in the
    # same micro-batches as the uninterrupted pipeline; a resumed pipeline that priced with token
    # counts (its default) would plan differently.
    model = CostModel({t: 0.0 for t in TERMS} | {"sum_L2": 1e-3, "sum_L": 1.0, "sum_P": 2.0})
    for rank in range(2):
        owner = _Owner()
        first = _pipeline(tokenizer, dp_rank=rank, dp_size=2, cost_models=owner)
        first.next_step()
        owner.switch(model)
        state = first.state_dict()
        expected = _steps(first, 3)
        resumed_owner = _Owner()  # the checkpoint restores the owner's model, then the data position
        resumed = _pipeline(tokenizer, dp_rank=rank, dp_size=2, cost_models=resumed_owner)
        resumed_owner.switch(model)
        resumed.load_state_dict(state)
        assert _steps(resumed, 3) == expected, rank
        assert first.balance_counters.applied > 1  # plans were made, not the arrival order kept
        token_priced = _pipeline(tokenizer, dp_rank=rank, dp_size=2, cost_models=_Owner())
        token_priced.load_state_dict(state)
        assert [plan for plan, _ in _steps(token_priced, 3)] != [plan for plan, _ in expected]


def test_prefetch_thread_and_model_switch_give_the_same_steps(tokenizer):
    model = CostModel({t: 0.0 for t in TERMS} | {"sum_L2": 1e-3, "sum_L": 1.0})
    owners = _Owner(), _Owner()
    plain = _pipeline(tokenizer, dp_rank=0, dp_size=2, cost_models=owners[0])
    threaded = DataPipeline(DataConfig(**{**_data().__dict__, "num_workers": 1}), MODEL, global_batch_size=4,
                            dp_rank=0, dp_size=2, pad_to_multiple=8, tokenizer=tokenizer,
                            balance_cfg=BalanceConfig(enabled=True, threshold=0.0), cost_models=owners[1])
    for step in range(4):
        if step == 2:  # both switch at the same consumed step; the thread's prefetched steps are redone
            owners[0].switch(model)
            owners[1].switch(model)
        assert _ids(plain.next_step()) == _ids(threaded.next_step())
    threaded.close()


def test_encoder_ranks_price_the_vision_terms_at_their_parallel_cost(tokenizer):
    # parallel.encoder_dp=full at TP 2 x PP 2: four ranks share a replica's encoder work, so the
    # planner sees a quarter of the vision price; the same plans as handing it that model directly.
    model = CostModel({t: 0.0 for t in TERMS} | {"sum_L": 1.0, "sum_P2": 0.5, "sum_P": 8.0})
    quarter = CostModel({t: 0.0 for t in TERMS} | {"sum_L": 1.0, "sum_P2": 0.125, "sum_P": 2.0})
    owners = _Owner(), _Owner()
    shared = _pipeline(tokenizer, dp_rank=0, dp_size=2, cost_models=owners[0], encoder_ranks=4)
    direct = _pipeline(tokenizer, dp_rank=0, dp_size=2, cost_models=owners[1])
    owners[0].switch(model)
    owners[1].switch(quarter)
    assert _steps(shared, 3) == _steps(direct, 3)
    assert shared._balancer.cost_model.coefficients["sum_P2"] == 0.125
