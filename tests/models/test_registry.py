import pytest

from loongforge.models import registry
from loongforge.models.qwen2_5_vl.model import build_model


def test_qwen2_5_vl_is_registered():
    assert registry.get_builder("qwen2_5_vl") is build_model
    assert "qwen2_5_vl" in registry.families()


def test_unknown_family_names_the_key():
    with pytest.raises(ValueError, match="model.family='llama'"):
        registry.get_builder("llama")
