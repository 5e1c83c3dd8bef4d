"""The family registry: every entry builds, and an unknown architecture is named."""

from __future__ import annotations

import pytest

from pyllm.model import registry
from pyllm.model.config import ModelConfig
from pyllm.model.llama import LlamaForCausalLM


@pytest.mark.parametrize("name", list(registry.FAMILIES))
def test_every_family_names_a_model_class(name):
    assert issubclass(registry.model_class(name), LlamaForCausalLM)


def test_unknown_hf_architecture_is_named_with_the_supported_ones():
    raw = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64}
    with pytest.raises(ValueError, match="unsupported architecture GPTNeoXForCausalLM") as error:
        ModelConfig.from_hf_dict(raw, source="neox/config.json")
    for family in registry.FAMILIES.values():
        assert family.hf_classes[0] in str(error.value)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt_neox'"):
        ModelConfig.from_hf_dict({"model_type": "gpt_neox"})


def test_unknown_gguf_architecture_is_named_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"'gptneox' in x\.gguf .*supported: llama, mistral"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gptneox"}, set(), "x.gguf")
