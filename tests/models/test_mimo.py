"""MiMo-V2-Flash's own paths (the text family, ``model.language.sliding_window``) that the concern tests do not walk:
its Hub config.json's window (``sliding_window_size``, one less than transformers' ``sliding_window``), its
multi-token-prediction layers (the Hub's ``model.mtp.*``, which transformers' class has no place for: noted, not
read), the sinks' and sliding layers' gradients against transformers', the section's checks (one line each,
naming the key), and its tokenizer, which ships in no package (the
preset names a local folder and a run without it stops in one line naming the download). The model itself is
the ``mimo_v2_flash`` reference of every concern (``tests/models/references.py``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config
from loongforge.data.tokenizer import check_tokenizer
from loongforge.models.hf.weights import hf_to_megatron, megatron_to_hf
from loongforge.models.registry import get_family
from tests.convert.helpers import invoke
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.llm_helpers import tiny_hf_config_dict
from tests.models.references import REFERENCES


def test_the_hubs_window_is_read_as_transformers_reads_it():
    from transformers import AutoConfig

    hub = {k: v for k, v in tiny_hf_config_dict("mimo_v2_flash").items() if k != "sliding_window"}
    hub["sliding_window_size"] = 4  # the tokens before the query, as the Hub's config.json states it
    ours = get_family("llm").config_from_hf(hub, "config.json").language
    theirs = AutoConfig.for_model(**hub)
    assert ours.sliding_window.size == theirs.sliding_window == 5
    assert ours.sliding_window.num_query_groups == 2 * hub["num_key_value_heads"] and ours.sliding_window.sinks
    assert ours.layer_types == theirs.layer_types and ours.moe.first_dense_layers == 1


def test_multi_token_prediction_tensors_are_noted_not_read(tmp_path):
    """The Hub's checkpoint holds its MTP layers under ``model.mtp.``; the round trip reads the rest exactly and
    counts them apart."""
    src = tmp_path / "hf"
    written = REFERENCES["mimo_v2_flash"].save_hf(src, small_vocabulary=True)
    save_file({"model.mtp.layers.0.enorm.weight": torch.ones(48), "model.mtp.layers.0.eh_proj.weight": torch.ones(48, 96)},
              str(src / "model-mtp.safetensors"), metadata={"format": "pt"})
    result = invoke(str(src), "--roundtrip", "--tp", "2")
    print(result.output.strip().splitlines()[-2:])
    assert result.exit_code == 0, result.output
    assert "2 tensors of the source not read (the family's unread prefixes)" in result.output
    assert result.output.strip().splitlines()[-1].endswith(
        f"{written} exact, 0 close, 0 different, 0 missing, 0 unexpected: EXACT")


def test_a_pipeline_stage_reads_each_layer_as_its_global_kind():
    """The two kinds' projections share a name: a stage's layer 0 is read and written by the rule of its global
    layer's kind (the sliding layer 0 at offset 0, the full layer 1 at offset 1: 4 and 2 key/value heads)."""
    reference = REFERENCES["mimo_v2_flash"]
    model_cfg = reference.model_cfg()
    hub = get_family("llm").to_hub_style(reference.hf_model(model_cfg).state_dict())
    key = "language_model.decoder.layers.0.self_attention.linear_qkv.weight"
    for offset, groups in ((0, 4), (1, 2)):
        ours = hf_to_megatron(hub, model_cfg, [key], layer_offset=offset)
        assert ours[key].shape[0] == 12 * 24 + groups * (24 + 16)
        back = megatron_to_hf([ours], model_cfg, layer_offset=offset)
        assert sorted(back) == [f"model.layers.{offset}.self_attn.{p}_proj.weight" for p in "kqv"]
        assert all(torch.equal(tensor, hub[name]) for name, tensor in back.items())


@pytest.mark.parametrize(("overrides", "expected"), [
    (["model.language.sliding_window.num_query_groups=3"],
     "model.language.sliding_window.num_query_groups=3 does not divide model.language.num_attention_heads=8"),
    (["model.language.layer_types=[full_attention,full_attention,full_attention,full_attention]"],
     "model.language.sliding_window is set but no entry of model.language.layer_types is sliding_attention"),
    (["parallel.world_size=2", "parallel.context_parallel_size=2"],
     "parallel.context_parallel_size=2: context parallelism with model.language.sliding_window is not proven"),
    (["model.language.sliding_window=null"],
     "model.language.layer_types names sliding_attention layers but model.language.sliding_window is null"),
])
def test_the_sections_problems_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_run_config("mimo-tiny", overrides=overrides)
    messages = [m for m in info.value.messages if expected in m]
    print(messages)
    assert len(messages) == 1 and "\n" not in messages[0]


def test_the_presets_tokenizer_download_is_named_in_one_line():
    data = load_run_config("mimo-v2-flash").data
    with pytest.raises(InputError) as error:
        check_tokenizer(data.tokenizer, data.tokenizer_repo)
    message = str(error.value)
    print(message)
    assert "\n" not in message and "XiaomiMiMo/MiMo-V2-Flash" in message


def test_the_sinks_and_the_sliding_layers_train_as_transformers_trains_them():
    """The loss's gradient reaches each sliding layer's sink logits (an additive mask column of SDPA) and its
    output projection as it reaches transformers' (eager attention, the sink a concatenated logit), on a row 8
    times the window."""
    init_megatron(rank=0, world_size=1, port=free_port())
    try:
        reference = REFERENCES["mimo_v2_flash"]
        model_cfg, hf_model, model = reference.pair()
        case = reference.sample(model_cfg, hf_model, seed=3, text_len=40)
        labels = torch.roll(case.ours["input_ids"], -1, dims=1)
        model(**case.ours, labels=labels)[:, :-1].mean().backward()  # [1, s] per token; the last has no next
        hf_labels = case.theirs["input_ids"]  # transformers shifts them itself: position t predicts t + 1
        hf_model(**case.theirs, labels=hf_labels).loss.backward()
        worst = 0.0
        for layer in (0, 2):  # the sliding layers
            ours = model.language_model.decoder.layers[layer].self_attention.core_attention.sinks.grad
            theirs = hf_model.model.layers[layer].self_attn.sinks.grad
            assert ours is not None and float(theirs.abs().max()) > 1e-4
            worst = max(worst, float((ours - theirs).abs().max()))
            ours_o = model.language_model.decoder.layers[layer].self_attention.linear_proj.weight.grad
            worst = max(worst, float((ours_o - hf_model.model.layers[layer].self_attn.o_proj.weight.grad).abs().max()))
        print(f"worst gradient difference {worst:.1e}")
        assert worst < 1e-7  # measured 3.4e-8
    finally:
        destroy_megatron()
