"""LoRA with the engine's other features on the CPU: MTP (the head drafts with the base weights,
the main model verifies under each request's adapter: the same tokens as AR), FP8 base weights
(the delta added after the FP8 GEMM: the adapter moves the logits as it moves the dense model's),
n samples (every sample on its request's adapter)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_fixtures import random_adapter  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402

PROMPTS = [[(3 * i + 7 * j) % 250 for j in range(n)] for i, n in enumerate((6, 21, 40))]


def engine(preset: str = "tiny-moe", strategy: dict | None = None, quantization: str | None = None):
    model = {"random": {"preset": preset, "seed": 2}, "dtype": "float32", "device": "cpu", "max_model_len": 128}
    if quantization:
        model["quantization"] = quantization
    return build_engine(EngineConfig.from_dict({
        "model": model, "backend": "reference", "strategy": strategy or {"name": "ar"},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "cache": {"block_size": 16, "num_blocks": 96}, "lora": {"max_loras": 2, "max_rank": 8}}))


def with_adapter(eng, seed: int = 4, scale: float = 2.0):
    cfg, tensors = random_adapter(eng, r=8, seed=seed, scale=scale)
    eng.load_lora_adapter("a", tensors=tensors, config=cfg)
    return cfg, tensors


def test_mtp_emits_ar_tokens_under_an_adapter():
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=1, lora_name=lo) for lo in ("a", None, "a")]
    ar = engine()
    with_adapter(ar)
    mtp = engine(strategy={"name": "mtp", "num_speculative_tokens": 2})
    with_adapter(mtp)
    want, got = ar.generate(PROMPTS, params), mtp.generate(PROMPTS, params)
    assert mtp.runner.model.mtp is not None and sum(o.num_draft_tokens for o in got) > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.token_logprobs), torch.tensor(w.token_logprobs), atol=1e-4, rtol=0)
    base = ar.generate(PROMPTS[:1], [SamplingParams(max_new_tokens=8, ignore_eos=True)])[0]
    assert base.token_ids != want[0].token_ids  # the adapter changes what MTP must reproduce


def first_logits(eng, lora: str | None) -> torch.Tensor:
    seen = []
    eng.on_logits = lambda seqs, logits: seen.append(logits[0].clone())
    eng.generate(PROMPTS[1:2], [SamplingParams(max_new_tokens=1, lora_name=lora)])
    return seen[0]


def test_fp8_base_weights_take_the_delta_after_the_gemm():
    """The delta an adapter makes on an FP8 model's logits is the delta it makes on the dense
    model's (its own rows computed from the same activations, up to the FP8 model's difference)."""
    dense, fp8 = engine("tiny-dense-b128"), engine("tiny-dense-b128", quantization="fp8")
    _, tensors = with_adapter(dense, scale=1.0)
    fp8.load_lora_adapter("a", tensors=tensors, config={"r": 8, "lora_alpha": 8})
    d = first_logits(dense, "a") - first_logits(dense, None)
    q = first_logits(fp8, "a") - first_logits(fp8, None)
    assert d.norm() > 0.1 and float((q - d).norm() / d.norm()) < 0.2


def test_n_samples_share_the_adapter():
    eng = engine()
    with_adapter(eng)
    out = eng.generate(PROMPTS[:1], [SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=3, lora_name="a")])
    alone = [eng.generate(PROMPTS[:1], [SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=3,
                                                       lora_name=lo)])[0] for lo in ("a", None)]
    assert [s.token_ids for s in out[0].samples] == [s.token_ids for s in alone[0].samples]
    assert [s.token_ids for s in out[0].samples] != [s.token_ids for s in alone[1].samples]


def test_base_requests_keep_their_bits_when_lora_is_on():
    """The same batch of base-model requests on an engine without LoRA and on one with adapters
    loaded (rows of slot -1 are left as the base GEMM made them): bitwise, dense and MoE.
    Negative control: one of them on an adapter changes."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    for preset in ("tiny-moe", "tiny-dense"):
        on = engine(preset)
        with_adapter(on)
        off = build_engine(EngineConfig.from_dict({**on.config.to_dict(), "lora": {}}))
        assert not off.model.lora_targets and on.model.lora_targets
        want, got = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
        assert [(o.token_ids, o.token_logprobs) for o in got] == [(o.token_ids, o.token_logprobs) for o in want]
        adapted = on.generate(PROMPTS[:1], [SamplingParams(max_new_tokens=6, ignore_eos=True, lora_name="a")])[0]
        assert adapted.token_logprobs != want[0].token_logprobs
