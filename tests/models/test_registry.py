"""The model-family contract: every registered family provides every field; unknown names say what to type."""

import dataclasses
import typing

import pytest
import torch

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.layout import LayoutRule
from loongforge.config.loader import load_run_config
from loongforge.config.schema import ModelConfig
from loongforge.config.validate import MODEL_FEATURE_FIELDS
from loongforge.models import family as family_module
from loongforge.models import registry
from loongforge.models.family import ChatFormat, ModelFamily
from loongforge.models.hf.rules import Rule
from loongforge.models.qwen2_5_vl.model import build_model

# Fields that hold data; every other field is a function of the family.
_VALUES = {"name": str, "hf_architectures": tuple, "hf_model_types": tuple, "layout": LayoutRule,
           "tiny_preset": str, "hf_model_class": (str, type(None)), "vision_part": (str, type(None)),
           "rope": (str, type(None)), "hf_unread": tuple, "features": frozenset}
# Fields a family may leave None: a text-only family has no vision encoder; one version, one tokenizer.
_OPTIONAL = {"build_encoder", "image_processing", "offline_tokenizer"}


@pytest.mark.parametrize("name", registry.families())
def test_every_family_provides_every_field(name):
    family = registry.get_family(name)
    assert isinstance(family, ModelFamily) and family.name == name
    for field in dataclasses.fields(ModelFamily):
        value = getattr(family, field.name)
        if field.name in _VALUES:
            assert isinstance(value, _VALUES[field.name]), field.name
        elif not (field.name in _OPTIONAL and value is None):
            assert callable(value), f"{name}: ModelFamily.{field.name} is not callable"
    assert family.features <= set(MODEL_FEATURE_FIELDS), family.features
    import transformers

    # A family reads and writes HF folders of its transformers class; a composition none describes, none.
    assert bool(family.hf_architectures and family.hf_model_types) == (family.hf_model_class is not None)
    assert family.hf_model_class is None or hasattr(transformers, family.hf_model_class), family.hf_model_class
    chat = family.chat(load_run_config(family.tiny_preset).model)
    assert isinstance(chat, ChatFormat)
    assert chat.turn_start and chat.turn_end and chat.jinja_template
    # A family that sees images has a block for images in its chat format (and one for videos where its
    # processor takes them: InternVL's writes videos as frames of images).
    assert bool(chat.image_block) == family.has_vision and (family.has_vision or not chat.video_block)
    assert family.has_vision == (load_run_config(family.tiny_preset).model.vision is not None)
    # A family that sees images serves with a processor; a text-only one with its tokenizer alone (a
    # composition does not serve: it has no HF export).
    tiny = load_run_config(family.tiny_preset)
    serves_images = family.has_vision and family.hf_model_class is not None
    assert bool(family.hf_processor_files(tiny.model, tiny.data)) == serves_images


@pytest.mark.parametrize("name", [name for name in registry.families()
                                  if registry.get_family(name).hf_model_class is not None])
def test_every_family_reads_the_config_it_writes(name):
    family = registry.get_family(name)
    model_cfg = load_run_config(family.tiny_preset).model
    assert model_cfg.family == name
    hf_config = family.config_to_hf(model_cfg)
    assert registry.family_of_hf_config(hf_config, "config.json") is family
    assert family.config_from_hf(hf_config, "config.json").family == name
    assert family.config_from_hf(hf_config, "config.json") == dataclasses.replace(
        model_cfg, reference_num_params=None, layer_backend=ModelConfig().layer_backend)
    assert family.count_parameters(model_cfg)["total"] > 0


def test_the_contract_lists_what_the_test_checks():
    assert set(_VALUES) <= {f.name for f in dataclasses.fields(ModelFamily)}
    # The contract names torch and Rule for type checkers only (it is read torch-free): give them here.
    hints = typing.get_type_hints(ModelFamily, {**vars(family_module), "torch": torch, "Rule": Rule})
    assert all(hints[name] is not typing.Any for name in hints)


def test_qwen2_5_vl_builds_through_its_family():
    assert registry.get_family("qwen2_5_vl").build.resolve() is build_model


def test_unknown_family_names_the_key_and_the_nearest_name():
    with pytest.raises(ConfigError) as error:
        registry.get_family("qwen25_vl")
    (message,) = error.value.messages
    choices = " | ".join(registry.families())  # every registered family, sorted
    assert choices.startswith("composition | ") and " | internvl | llava_onevision | " in choices
    assert message == (f"model.family='qwen25_vl' is not one of {choices}; did you mean 'qwen2_5_vl'? set "
                       "model.family to one of those.")
    with pytest.raises(ConfigError) as error:
        registry.get_family("gemma")
    assert error.value.messages == [f"model.family='gemma' is not one of {choices}; set model.family to one of those."]


def test_a_config_naming_no_family_is_refused_in_one_line():
    """The schema names no family or tower: a config without model.family (a preset's removed here) is
    refused naming the key and the choices, before anything is built; the tower is the family's own."""
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["~model.family", "~model.vision.arch"])
    assert (cfg.model.family, cfg.model.vision.arch) == ("", None)
    with pytest.raises(ConfigError) as error:
        registry.check_family_layout(cfg)
    (message,) = error.value.messages
    assert message == f"model.family is not set; set it to one of {' | '.join(registry.families())}."
    registry.check_family_layout(load_run_config("qwen2.5vl-tiny", overrides=["~model.vision.arch"]))


def test_unsupported_hf_architecture_names_what_was_found():
    with pytest.raises(InputError, match=r"x/config.json: unsupported architecture GemmaForCausalLM"):
        registry.family_of_hf_config({"architectures": ["GemmaForCausalLM"]}, "x/config.json")


def test_a_familys_own_layout_rule_is_checked_above_config_loading():
    # Config loading knows the decoder rule only: Qwen3-VL implements encoder_dp none and tp, which
    # its family's rule adds (a vision TP below the language TP it takes from the composition).
    overrides = ["parallel.tensor_model_parallel_size=2", "parallel.vision_tensor_model_parallel_size=1",
                 "parallel.encoder_dp=full"]
    cfg = load_run_config("qwen3vl-tiny", overrides=overrides, world_size=2)
    with pytest.raises(ConfigError) as refused:
        registry.check_family_layout(cfg)
    assert refused.value.messages == [
        "parallel.encoder_dp=full: model.family=qwen3_vl implements none | tp; set parallel.encoder_dp=none."]
    registry.check_family_layout(load_run_config("qwen2.5vl-tiny", overrides=overrides, world_size=2))
    registry.check_family_layout(load_run_config("qwen3vl-tiny", overrides=[*overrides[:2], "parallel.encoder_dp=tp"],
                                                 world_size=2))
    registry.check_family_layout(load_run_config("qwen3vl-tiny", overrides=overrides[:1], world_size=2))


def test_a_packing_encoder_refuses_to_be_shared_in_one_line_each():
    """LLaVA-OneVision's encoder packs each image by its size: encoder_dp tp and, under CP, encoder_cp are
    refused before anything is built, each in one line naming the fix."""
    tiny = registry.get_family("llava_onevision").tiny_preset
    for overrides, expected in (
            (["parallel.tensor_model_parallel_size=2", "parallel.encoder_dp=tp",
              "parallel.vision_tensor_model_parallel_size=1"], "set parallel.encoder_dp=none."),
            (["parallel.context_parallel_size=2", "parallel.encoder_cp=true"], "set parallel.encoder_cp=false.")):
        cfg = load_run_config(tiny, overrides=overrides, world_size=2)
        with pytest.raises(ConfigError) as error:
            registry.check_family_layout(cfg)
        (message,) = error.value.messages
        assert message.endswith(expected), message
    registry.check_family_layout(load_run_config(tiny, overrides=["parallel.context_parallel_size=2",
                                                                  "parallel.encoder_cp=false"], world_size=2))


def _family_problem(preset: str, *overrides: str) -> str:
    """The one problem ``check_family_layout`` finds in ``preset`` with ``overrides`` (printed)."""
    with pytest.raises(ConfigError) as info:
        registry.check_family_layout(load_run_config(preset, overrides=list(overrides)))
    (message,) = info.value.messages
    print(message)
    return message


def test_a_layer_kind_the_family_does_not_build_is_refused_naming_the_families_that_do():
    message = _family_problem("qwen2.5vl-tiny", "model.language.moe.num_experts=4", "model.language.moe.ffn_hidden_size=64")
    assert message == ("model.language.moe is set but model.family=qwen2_5_vl does not build experts "
                       "(model.family=ernie4_5_vl or llm or qwen3_5 or qwen3_vl builds it); set model.language.moe=null "
                       "or choose such a family.")
    assert _family_problem("qwen3vl-tiny", "model.chat_format=chatml").startswith(
        "model.chat_format='chatml' but model.family=qwen3_vl does not build chat format "
        "(model.family=llm or qwen3_5 builds it)")


def test_the_stated_text_architecture_decides_and_a_contradiction_is_refused():
    from loongforge.models.decoder.text_config import architecture

    llama = load_run_config("llama-tiny")
    assert architecture(llama.model.language) == "LlamaForCausalLM"
    # Stated as Qwen2 with Llama's switches: the layers would not be what the name says.
    message = _family_problem("llama-tiny", "model.language.architecture=Qwen2ForCausalLM")
    assert message == ("model.language.architecture=Qwen2ForCausalLM but model.language has add_qkv_bias: false; "
                       "Qwen2ForCausalLM has add_qkv_bias: true, qk_norm: false, moe set: false, "
                       "multi_latent_attention set: false.")
    assert _family_problem("llama-tiny", "model.language.architecture=MistralForCausalLM").startswith(
        "model.language.architecture=MistralForCausalLM is not one of ")
    # A config saved before the architecture was stated reads it from its switches.
    llama.model.language.architecture = None
    assert architecture(llama.model.language) == "LlamaForCausalLM"
