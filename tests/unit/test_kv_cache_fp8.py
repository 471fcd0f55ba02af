"""``cache.kv_cache_dtype: fp8``: keys and values stored as float8_e4m3fn at a fixed scale of 1
(ops/attention.py). Config, cache, sizing and backend selection here; the kernels' bitwise
checks are in tests/kernels (test_invariance_interp.py, test_engine_triton.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, SamplingParams, build_engine
from bi_core.runtime.build import explain

PROMPTS = [[(5 * i + 3) % 250 for i in range(30)], [5, 4, 3]]


def _engine(**cache):
    return build_engine(EngineConfig.from_dict(tiny_config(cache={"kv_cache_dtype": "auto", **cache})))


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_both_spellings_give_an_fp8_cache(name):
    eng = _engine(kv_cache_dtype=name)
    caches = eng.runner.cache.main
    assert {t.dtype for t in (*caches.k, *caches.v)} == {torch.float8_e4m3fn}
    assert {t.dtype for t in caches.conv} == {torch.float32}  # GDN states keep theirs


def test_other_values_are_refused_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype.*auto, fp8, fp8_e4m3"):
        EngineConfig.from_dict(tiny_config(cache={"kv_cache_dtype": "fp16"}))


def test_the_reference_engine_runs_on_an_fp8_cache_close_to_a_full_precision_one():
    """The reference backend (float32 model) over an FP8 cache: the same greedy tokens as over a
    float32 cache on this tiny model, logprobs within 0.05 but not all equal (the cache's
    rounding shows: the FP8 cache is really read)."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=1)
    full, fp8 = (_engine(kv_cache_dtype=kv).generate(PROMPTS, params) for kv in ("auto", "fp8"))
    diffs = []
    for a, b in zip(full, fp8):
        assert a.token_ids == b.token_ids
        diffs += [abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)]
    assert max(diffs) < 0.05 and max(diffs) > 0


def test_pages_copy_byte_for_byte():
    """The prefix cache's page copies on an FP8 cache (indexing ops run on its bytes)."""
    cache = _engine(kv_cache_dtype="fp8").runner.cache
    k = cache.main.k[0]
    k.view(torch.uint8)[3] = torch.randint(0, 120, k[3].shape, dtype=torch.uint8)
    cache.copy_pages([3], [7])
    assert torch.equal(k.view(torch.uint8)[7], k.view(torch.uint8)[3]) and k.view(torch.uint8)[3].any()


def _explain(backend: str, batch_invariant: bool, kv: str) -> str:
    return explain(EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "qwen3.5-35b-a3b", "num_hidden_layers": 4, "seed": 0}, "dtype": "bfloat16",
               "device": "cuda", "max_model_len": 4096},
        backend=backend, policy={"batch_invariant": batch_invariant}, cache={"kv_cache_dtype": kv})))


def test_the_invariant_backend_serves_it_and_the_default_one_says_why_not():
    """Planned for an H100/H200 (explain, no GPU needed): the invariant attention takes the FP8
    cache, the default backend's (FlashInfer) refuses it with the reason and the way out."""
    attention_line = lambda text: next(line for line in text.splitlines() if line.startswith("attention "))
    assert "-> cuda_hopper_invariant" in attention_line(_explain("cuda_hopper_invariant", True, "fp8"))
    default = _explain("cuda_default", False, "fp8")
    assert "-> NONE" in attention_line(default)
    assert "KV cache fp8_e4m3: FlashInfer's FP8 KV path is not wired here yet (policy.ops: {attention: " \
           "cuda_hopper_invariant} serves it in default mode)" in default
    assert "FP8 KV path" not in _explain("cuda_default", False, "auto")
    assert "KV cache (float8_e4m3fn) 1.0 KiB per token" in default


def test_sizing_counts_one_byte_per_element():
    from bi_core.quant.sizing import state_bytes
    from bi_core.runtime.build import resolve_model

    configs = [EngineConfig.from_dict(tiny_config(cache={"kv_cache_dtype": kv}, model={"dtype": "bfloat16"}))
               for kv in ("auto", "fp8")]
    (kv_full, gdn_full), (kv_fp8, gdn_fp8) = (state_bytes(resolve_model(c)[0], c, torch.bfloat16, 1, False)
                                              for c in configs)
    assert kv_fp8 * 2 == kv_full and gdn_fp8 == gdn_full
