"""MiMo-V2-Flash's own paths (the text family, ``model.language.sliding_window``) that the concern tests do not walk:
its Hub config.json's window (``sliding_window_size``, one less than transformers' ``sliding_window``), its
multi-token-prediction layers (the Hub's ``model.mtp.*``, which transformers' class has no place for: noted, not
read), the section's checks (one line each, naming the key), and its tokenizer, which ships in no package (the
preset names a local folder and a run without it stops in one line naming the download). The model itself is
the ``mimo_v2_flash`` reference of every concern (``tests/models/references.py``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config
from loongforge.data.tokenizer import check_tokenizer
from loongforge.models.registry import get_family
from tests.convert.helpers import invoke
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
