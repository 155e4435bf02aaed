"""Pipeline stages: even splits, megatron-core's layout strings (parsed as megatron parses them) and
the checks that name what is wrong."""

import pytest

from loongforge.config.pipeline_layout import (
    PipelineStages,
    layout_string,
    parse_stages,
    pipeline_layout_problems,
    stage_plan,
    virtual_stages,
)
from loongforge.config.schema import ParallelConfig

LAYOUTS = ["Et|ttt|ttt|tL", "E|(tt|)*3tL", "Et*3|t*3|t*2L", "Ettt|(tt|)*29,m|L", "E(t|)*2(tt)*2L", "EtL"]


@pytest.mark.parametrize("text", LAYOUTS)
def test_layout_strings_parse_as_megatron_core_parses_them(text):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    theirs = PipelineParallelLayerLayout.parse_str_to_list(text)
    symbols = {"embedding": "E", "decoder": "t", "loss": "L", "mtp": "m"}
    expected = ["".join(symbols[layer.name] for layer in stage) for stage in theirs]
    assert parse_stages(text) == expected


def _parallel(pp=1, vp=None, layout=None) -> ParallelConfig:
    return ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                          pipeline_layout=layout)


def test_even_stages_number_layers_in_schedule_order():
    plan = stage_plan(8, _parallel(pp=2, vp=2))
    assert plan.layers == ((2, 2), (2, 2))
    # rank 0 holds layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7
    assert [plan.first_layer(rank, stage) for rank in (0, 1) for stage in (0, 1)] == [0, 4, 2, 6]


def test_a_layout_places_layers_per_stage_and_implies_the_virtual_size():
    parallel = _parallel(pp=2, layout="Et|ttt|ttt|tL")
    assert virtual_stages(parallel) == 2
    plan = stage_plan(8, parallel)
    assert plan.layers == ((1, 3), (3, 1)) and plan.rank_layers(0) == 4
    assert plan.first_layer(1, 1) == 7
    assert parse_stages(layout_string(plan)) == parse_stages("Et|ttt|ttt|tL")
    assert layout_string(PipelineStages(((2,), (2,)))) == "Et*2|t*2L"
    assert layout_string(PipelineStages(((2,), (2,))), mtp_layers=1) == "Et*2|t*2mL"


@pytest.mark.parametrize("parallel, message", [
    (_parallel(pp=2, vp=2), "parallel.pipeline_model_parallel_size=2 x parallel.virtual_pipeline_model_parallel_size=2 = 4 stages does not divide model.language.num_layers=6"),
    (_parallel(pp=1, vp=2), "needs parallel.pipeline_model_parallel_size > 1"),
    (_parallel(pp=2, vp=0), "must be at least 1"),
    (_parallel(pp=2, layout="Et|ttt|tttL"), "has 3 stages; it needs a multiple of parallel.pipeline_model_parallel_size=2"),
    (_parallel(pp=2, vp=3, layout="Et|ttt|tt|L"), "it needs parallel.pipeline_model_parallel_size x parallel.virtual_pipeline_model_parallel_size = 2 x 3 = 6"),
    (_parallel(pp=2, layout="Et|tttL"), "places 4 language layers; model.language.num_layers=6"),
    (_parallel(pp=2, layout="tt|EtttL"), "the embedding E must appear once, in the first stage"),
    (_parallel(pp=2, layout="Ett|tLtt"), "L must close the last stage"),
    (_parallel(pp=2, layout="Ett|(tt*3L"), "unbalanced parentheses"),
    (_parallel(pp=2, layout="Ett|tqtL"), "unknown symbol 'q'"),
])
def test_each_wrong_split_is_named(parallel, message):
    problems = pipeline_layout_problems(6, parallel)
    print(problems)
    assert any(message in problem for problem in problems)


def test_multi_token_prediction_layers_close_the_last_stage():
    """megatron runs the MTP layers after the decoder, on the head's stage: m, as many as the model has, before L."""
    assert not pipeline_layout_problems(6, _parallel(pp=2, layout="Ettt|tttmL"), mtp_layers=1)
    for layout, mtp_layers in (("Ettt|tttL", 1), ("Ettt|tttmL", 0), ("Ettm|ttttL", 1), ("Ettt|tttmmL", 1)):
        problems = pipeline_layout_problems(6, _parallel(pp=2, layout=layout), mtp_layers=mtp_layers)
        assert problems == [f"parallel.pipeline_layout='{layout}': model.language.mtp_num_layers={mtp_layers} "
                            f"multi-token-prediction layers go in the last stage as m, just before L (megatron runs "
                            f"them after the decoder); place {mtp_layers}."], layout


def test_deepstack_layers_must_stay_on_the_first_stage():
    problems = pipeline_layout_problems(8, _parallel(pp=2, layout="Et|ttt|ttt|tL"), first_stage_layers=3,
                                        first_stage_reason="DeepStack adds features after")
    assert problems == ["the first pipeline stage holds 1 language layer, but DeepStack adds features after the "
                        "first 3, which must all be there; give it more (parallel.pipeline_layout) or lower the "
                        "pipeline sizes."]
    assert not pipeline_layout_problems(8, _parallel(pp=2, layout="Ettt|t|ttt|tL"), first_stage_layers=3)
