"""LoRA's config section and what ``bi-engine explain`` says of it."""

from __future__ import annotations

import pytest

from bi_core import EngineConfig
from bi_core.errors import ConfigError
from bi_core.runtime.build import explain


def test_explain_names_the_lora_op_and_its_memory():
    text = explain(EngineConfig.from_dict({"model": {"random": {"preset": "tiny-moe"}, "device": "cpu"},
                                           "lora": {"max_loras": 2, "max_rank": 8}}))
    assert "lora          -> reference" in text and "2 slots of rank 8" in text
    assert "lora" not in explain(EngineConfig.from_dict({"model": {"random": {"preset": "tiny-moe"}, "device": "cpu"}}))



def test_explain_counts_the_expert_stacks():
    """lora.experts: the MoE layers' expert stacks are named."""
    def text(**lora):
        return explain(EngineConfig.from_dict({"model": {"random": {"preset": "tiny-moe"}, "device": "cpu"},
                                               "lora": {"max_loras": 2, "max_rank": 8, **lora}}))

    off, on = text(), text(experts=True)
    assert "MoE layers' experts adapted" in on and "experts adapted" not in off


def test_expert_adapters_on_fp8_experts_are_refused():
    with pytest.raises(ConfigError, match=r"^lora\.experts: adapters on FP8 MoE experts are not supported"):
        explain(EngineConfig.from_dict({"model": {"random": {"preset": "tiny-moe-b128"}, "device": "cpu",
                                                  "quantization": "fp8"},
                                        "lora": {"max_loras": 2, "max_rank": 8, "experts": True}}))


@pytest.mark.parametrize("lora,path", [
    ({"max_loras": -1}, "lora.max_loras"), ({"max_rank": 0}, "lora.max_rank"),
    ({"adapters": ["a"]}, "lora.adapters"), ({"max_loras": 1, "adapters": {"": "/x"}}, "lora.adapters"),
    ({"max_loras": 1, "adapters": {"a": "/x", "b": "/y"}}, "lora.adapters"), ({"slots": 2}, "lora.slots"),
    ({"experts": "yes"}, "lora.experts")])
def test_bad_lora_config_names_the_key(lora, path):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_dict({"model": {"random": {"preset": "tiny-dense"}}, "lora": lora})
    assert str(e.value).startswith(path)
