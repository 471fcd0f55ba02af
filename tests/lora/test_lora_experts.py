"""LoRA on the MoE experts (``lora.experts``): PEFT adapters on the routed experts' fused
parameters (``target_parameters``) and on the shared expert, served against PEFT on transformers'
own tiny Qwen3.5 MoE (float32, the reference backend); the refusals that remain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hf_fixtures import hf_greedy, make_hf_model, save_checkpoint  # noqa: E402
from lora_fixtures import engine_config, make_adapter, save_adapter  # noqa: E402
from test_peft_conformance import PROMPTS, STEPS, first_logits_and_outputs, rel_err  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402
from bi_core.errors import CheckpointError  # noqa: E402

pytest.importorskip("peft")
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHARED = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]


def expert_adapter(hf_model, path: Path, *, targets, params, r: int = 4, alpha: float = 8.0, seed: int = 1):
    """A PEFT LoRA on the shared expert (``targets``) and the experts' parameters (``params``)."""
    return make_adapter(hf_model, path, r=r, alpha=alpha, seed=seed, targets=targets, params=params, scale=0.5)


@pytest.mark.parametrize("targets,params", [(SHARED, EXPERT_PARAMS), (["q_proj"], EXPERT_PARAMS[1:]),
                                            (SHARED[:2], [])], ids=["both", "down-only", "shared-only"])
def test_expert_adapters_match_peft(tmp_path, targets, params):
    """First-token logits close to PEFT's and the same greedy tokens; the adapter moves the logits
    (the comparison can fail); the base rows are the base model's."""
    hf = make_hf_model("moe")
    ckpt = save_checkpoint(hf, tmp_path / "ckpt")
    peft_model = expert_adapter(hf, tmp_path / "adapter", targets=targets, params=params)
    engine = build_engine(EngineConfig.from_dict(engine_config(ckpt, {"a": str(tmp_path / "adapter")}, max_rank=8,
                                                               experts=True)))
    outs, logits = first_logits_and_outputs(engine, SamplingParams(max_new_tokens=STEPS, ignore_eos=True,
                                                                   lora_name="a"))
    _, base_logits = first_logits_and_outputs(engine, SamplingParams(max_new_tokens=STEPS, ignore_eos=True))
    for prompt, out, ours, base in zip(PROMPTS, outs, logits, base_logits):
        tokens, _, first = hf_greedy(peft_model, prompt, STEPS)
        assert rel_err(ours, first) < 1e-4
        assert rel_err(base, first) > 1e-2
        assert out.token_ids == tokens
    with peft_model.disable_adapter():
        for prompt, base in zip(PROMPTS, base_logits):
            assert rel_err(base, hf_greedy(peft_model, prompt, 1)[2]) < 1e-4


def test_refusals(tmp_path):
    """Expert adapters without lora.experts name the setting; lm_head, embeddings and other
    parameters stay refused by name; an expert parameter of the wrong shape names its shapes."""
    import torch

    hf = make_hf_model("moe")
    ckpt = save_checkpoint(hf, tmp_path / "ckpt")
    expert_adapter(hf, tmp_path / "experts", targets=SHARED[:1], params=EXPERT_PARAMS)
    off = build_engine(EngineConfig.from_dict(engine_config(ckpt)))
    with pytest.raises(CheckpointError, match=r"shared_expert\.gate_proj.*lora\.experts: true") as err:
        off.load_lora_adapter("x", tmp_path / "experts")
    assert "mlp.experts.base_layer (expert parameters: the MoE experts" in str(err.value)
    on = build_engine(EngineConfig.from_dict(engine_config(ckpt, experts=True)))
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]}
    head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(300, 4)}
    with pytest.raises(CheckpointError, match=r"lm_head \(no adaptable projection.*not lm_head or embeddings"):
        on.load_lora_adapter("h", save_adapter(tmp_path / "head", cfg, head))
    with pytest.raises(CheckpointError, match=r"target_parameters \['mlp\.gate\.weight'\]: only the MoE experts'"):
        on.load_lora_adapter("p", save_adapter(tmp_path / "param", cfg | {"target_parameters": ["mlp.gate.weight"]},
                                               head))
    wrong = {"base_model.model.model.layers.1.mlp.experts.lora_A.weight": torch.zeros(4 * 8, 10),
             "base_model.model.model.layers.1.mlp.experts.lora_B.weight": torch.zeros(64, 4 * 8)}
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts: lora_A \(32, 10\).*are neither"):
        on.load_lora_adapter("w", save_adapter(tmp_path / "wrong", cfg | {"target_parameters": EXPERT_PARAMS}, wrong))
    assert not on.lora_adapters()


def test_a_moe_builder_that_does_not_declare_lora_never_gets_a_lora_spec():
    """``MoEBuilder.contract_refusals``: a builder without ``serves_lora`` (a plugin's, or
    cuda_grouped_mm's) is refused a ``lora`` spec before its own check; the reference takes it,
    not with FP8 experts."""
    import torch

    from bi_core.backends.cuda_grouped_mm import GroupedMMMoEBuilder
    from bi_core.backends.reference.moe import ReferenceMoEBuilder
    from bi_core.ops import MoEBuilder, MoESpec

    class ThirdParty(MoEBuilder):
        def check(self, spec, policy):
            return []

        def build(self, spec):
            raise AssertionError("never built")

    base = dict(device=torch.device("cpu"), dtype=torch.float32, num_experts=8, top_k=2, hidden_size=256,
                intermediate_size=256)
    lora = MoESpec(**base, lora=True)
    assert ThirdParty().check(MoESpec(**base), None) == []
    why = "MoE experts with LoRA adapters (lora.experts): this builder's impl does not apply them"
    assert ThirdParty().check(lora, None) == [why]
    assert why in GroupedMMMoEBuilder().check(lora, None)
    assert ReferenceMoEBuilder().check(lora, None) == []
    fp8 = ReferenceMoEBuilder().check(MoESpec(**base, lora=True, weight_format="fp8_block", block_size=(128, 128)),
                                      None)
    assert fp8 == ["MoE experts with LoRA adapters (lora.experts) on FP8 experts: not supported yet"]


def test_a_slot_reused_without_experts_holds_no_expert_delta():
    """One slot: an adapter with expert tensors, unloaded, then one without: the slot's expert rows
    are zeros again (and were not before), so the second adapter's requests get no stale delta."""
    from bi_core.lora.experts import ExpertTarget
    from bi_core.lora.synthetic import random_adapter

    engine = build_engine(EngineConfig.from_dict({
        "model": {"random": {"preset": "tiny-moe", "seed": 3, "num_hidden_layers": 2}, "device": "cpu"},
        "lora": {"max_loras": 1, "max_rank": 8, "experts": True}}))
    experts = [t for t in engine.model.lora_targets.values() if isinstance(t, ExpertTarget)]
    assert experts

    def expert_sum():
        return sum(float(t.abs().sum()) for x in experts for t in (*x.routed, *x.shared))

    cfg, tensors = random_adapter(engine, r=4, seed=1)
    engine.load_lora_adapter("with", tensors=tensors, config=cfg)
    assert expert_sum() > 0
    engine.unload_lora_adapter("with")
    plain = {k: v for k, v in tensors.items() if ".experts" not in k and ".shared_expert." not in k}
    engine.load_lora_adapter("without", tensors=plain, config={"r": 4, "lora_alpha": 4})
    assert engine.lora_adapters()[0].slot == 0 and expert_sum() == 0
