"""Which projections are FP8: config.json's quantization_config (the official block-wise FP8 only,
anything else refused with one error naming what is supported) and model.quantization."""

from __future__ import annotations

import pytest
from fp8_fixtures import LAYER_TYPES, compressed_tensors_config, quantization_config

from bi_core import CheckpointError, ConfigError, EngineConfig
from bi_core.models.args import ModelArgs
from bi_core.models.presets import preset_args
from bi_core.quant.scheme import GDN, OFFICIAL_DENSE, Fp8Scheme, from_quantization_config, resolve

SUPPORTED = "supported: the official block-wise FP8 of Qwen3.5-*-FP8"


def scheme(qc: dict, is_moe: bool = True) -> Fp8Scheme:
    return from_quantization_config(qc, LAYER_TYPES, is_moe, has_mtp=True)


def test_the_official_config_keeps_gdn_b_a_and_mtp_fc_unquantized():
    s = scheme(quantization_config())
    assert s.dense == OFFICIAL_DENSE and s.mtp_dense == {"fc"} and s.block == (128, 128)
    assert s.weights("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj").block == (128, 128)
    assert s.weights("linear_attn.in_proj_b", "linear_attn.in_proj_a") is None
    assert s.for_mtp().weights("fc") is None and s.for_mtp().weights("mlp.experts") is not None


def test_multimodal_names_and_regex_patterns_match_like_transformers():
    qc = quantization_config()
    qc["modules_to_not_convert"] = ["lm_head", "mtp.fc"] + [
        f"model.language_model.layers.{i}.linear_attn.in_proj_{x}" for i in (0, 2, 3) for x in "ab"]
    assert scheme(qc).dense == OFFICIAL_DENSE
    qc["modules_to_not_convert"] = [r"model\.layers\.\d+\.linear_attn\.in_proj_[ab]", "self_attn"]
    assert scheme(qc).dense == OFFICIAL_DENSE  # "self_attn" names no module (not from the start, not a suffix)
    qc["modules_to_not_convert"] = ["model.layers.1.self_attn", "model.layers.4.self_attn", "mlp.experts",
                                    "linear_attn.in_proj_a", "linear_attn.in_proj_b"]  # suffixes name modules too
    s = scheme(qc)
    assert s.dense == OFFICIAL_DENSE | {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.experts"}
    assert "mlp.experts" in s.mtp_dense and "self_attn.q_proj" not in s.mtp_dense


@pytest.mark.parametrize("change,named", [
    ({"quant_method": "compressed-tensors"}, "(quant_method compressed-tensors): config_groups None"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"weight_block_size": None}, "weight_block_size None"),
    ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
])
def test_other_formats_are_refused_naming_what_is_supported(change, named):
    with pytest.raises(CheckpointError) as e:
        scheme({**quantization_config(), **change})
    assert "config.json quantization_config" in str(e.value) and named in str(e.value)
    assert SUPPORTED in str(e.value)


def test_one_format_per_kind_and_per_fused_projection():
    qc = quantization_config()
    qc["modules_to_not_convert"] = qc["modules_to_not_convert"] + ["model.layers.0.linear_attn.out_proj"]
    with pytest.raises(CheckpointError, match="keeps linear_attn.out_proj unquantized in layers.0 but not in layers.2"):
        scheme(qc)
    qc = quantization_config()
    qc["modules_to_not_convert"] = qc["modules_to_not_convert"] + ["model.layers.1.self_attn.k_proj",
                                                                   "model.layers.4.self_attn.k_proj"]
    with pytest.raises(CheckpointError, match="q_proj, self_attn.k_proj, self_attn.v_proj are fused"):
        scheme(qc).weights("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qc = quantization_config()
    qc["modules_to_not_convert"] = qc["modules_to_not_convert"] + ["model.layers.0.mlp.experts.0.gate_proj"]
    with pytest.raises(CheckpointError, match="some linears of mlp.experts"):
        scheme(qc)


def test_model_quantization_setting():
    assert resolve(None, None) is None and resolve("none", None) is None
    assert resolve("fp8", None) == Fp8Scheme()
    official = scheme(quantization_config())
    assert resolve("fp8", official) is official and resolve(None, official) is official
    with pytest.raises(ConfigError, match="model.quantization: none, but the checkpoint is FP8"):
        resolve("none", official)
    with pytest.raises(ConfigError, match="model.quantization: expected one of none, fp8; got 'int4'"):
        EngineConfig.from_dict({"model": {"random": {"preset": "tiny-dense"}, "quantization": "int4"}})
    assert preset_args("tiny-moe-b128", quantization="fp8").quantization == Fp8Scheme()
    hf = {"model_type": "qwen3_5_text", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 1, "num_key_value_heads": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "intermediate_size": 8,
          "layer_types": ["full_attention"], "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(CheckpointError, match="quant_method 'bitsandbytes'"):
        ModelArgs.from_hf_config(hf)


def test_compressed_tensors_targets_and_ignore():
    """compressed-tensors names its quantized linears by ``targets`` (``Linear``: all; ``re:`` patterns
    from the start of a name; else the name itself) less ``ignore``; a container (the experts) is FP8
    when its linears are. FP8_BLOCK with ``targets: [Linear]`` and the official exclusions is the
    official scheme, its scales named ``weight_scale``."""
    s = scheme(compressed_tensors_config())
    assert s.dense == OFFICIAL_DENSE and s.mtp_dense == {"fc"} and s.scale_suffix == "_scale"
    assert scheme(quantization_config()).scale_suffix == "_scale_inv"
    qc = compressed_tensors_config()
    qc["config_groups"]["group_0"]["targets"] = [r"re:.*self_attn\.[qkvo]_proj$",
                                                 r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    qc["ignore"] = ["model.layers.4.self_attn.q_proj", "model.layers.4.self_attn.k_proj",
                    "model.layers.4.self_attn.v_proj", "model.layers.4.self_attn.o_proj"]
    with pytest.raises(CheckpointError, match="keeps self_attn.q_proj unquantized in layers.4 but not in layers.1"):
        scheme(qc)
    qc["ignore"] = []
    s = scheme(qc)
    assert s.dense == set(GDN) | {"mlp.shared_expert"}
    assert s.weights("mlp.experts") is not None and s.weights("self_attn.o_proj") is not None
    assert s.for_mtp().weights("fc") is None  # mtp.fc is no target
