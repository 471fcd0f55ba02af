"""Calibrated k/v scales for an FP8 KV cache (compressed-tensors' ``kv_cache_scheme``: one static
scale per layer for keys and one for values, ``self_attn.k_scale`` / ``v_scale``): loaded per
layer, stored and read at by the reference backend (the Triton kernels' bitwise checks against it
are in tests/kernels/test_invariance_interp.py), refused when malformed."""

from __future__ import annotations

import pytest
import torch
from fp8_fixtures import ATTENTION, KV_SCHEME, kv_scaled_checkpoint, make_hf_b128

import bi_core.backends.reference.attention as reference_attention
from bi_core import BackendSelectionError, CheckpointError, EngineConfig, SamplingParams, build_engine

PROMPTS = [[(7 * i + j) % 300 for i in range(n)] for j, n in enumerate((20, 45))]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def hf():
    return make_hf_b128("dense")


def engine(path, kv="fp8"):
    return build_engine(EngineConfig.from_dict({
        "model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 128},
        "cache": {"block_size": 16, "num_blocks": 64, "kv_cache_dtype": kv}}))


def scales_of(eng) -> list:
    return [m.kv_scales for m in eng.model.modules() if hasattr(m, "read_kv_scales")]


def logprobs(eng) -> list[list[float]]:
    return [o.token_logprobs for o in eng.generate(PROMPTS, PARAMS)]


def first_error(got, full) -> float:
    """The largest difference of each prompt's first token's logprob (its prompt's context only: on
    this tiny random model an FP8 cache changes later greedy tokens, so later positions part)."""
    return max(abs(g[0] - f[0]) for g, f in zip(got, full))


def test_scales_load_per_layer_and_scale_the_cache(hf, tmp_path, monkeypatch):
    """Each attention layer reads its own scales (as float32 numbers); the cache is stored at
    them (other logprobs than at scale 1), and read at them: as close to a float32 cache as the
    unscaled FP8 cache is, where keys written at scale 1 but read at the checkpoint's are far off
    (negative control); scales of 1 are the unscaled FP8 cache exactly (the same logprobs)."""
    scales = {ATTENTION[0]: (0.37, 2.9), ATTENTION[1]: (0.05, 0.6)}
    path = kv_scaled_checkpoint(hf, tmp_path / "scaled", scales)
    eng = engine(path)
    assert eng.args.kv_scales
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    assert scales_of(eng) == [(f32(k), f32(v)) for k, v in scales.values()]
    scaled = logprobs(eng)
    ones = logprobs(engine(kv_scaled_checkpoint(hf, tmp_path / "ones", {i: (1.0, 1.0) for i in ATTENTION})))
    unscaled = logprobs(engine(kv_scaled_checkpoint(hf, tmp_path / "plain", None, scheme=None)))
    full = logprobs(engine(tmp_path / "plain", kv="auto"))
    assert ones == unscaled
    assert scaled != ones
    assert first_error(scaled, full) < max(0.02, 2 * first_error(unscaled, full))
    monkeypatch.setattr(reference_attention, "inv_scale", lambda scale: 1.0)  # written unscaled, read scaled
    assert first_error(logprobs(engine(path)), full) > 3 * max(0.02, first_error(unscaled, full))


def test_scales_go_unused_without_an_fp8_cache(hf, tmp_path):
    """A bf16/fp32 cache holds keys and values as they are: the scales scale nothing (logged)."""
    eng = engine(kv_scaled_checkpoint(hf, tmp_path / "ct", {i: (0.37, 2.9) for i in ATTENTION}), kv="auto")
    assert not eng.args.kv_scales and scales_of(eng) == [None] * len(ATTENTION)


def test_refusals(hf, tmp_path):
    """A scheme other than one static float scale per tensor, a missing or non-positive scale, and
    an update of a scale (the cache holds values stored at it) are refused by name."""
    for change, match in (({"strategy": "channel"}, r"kv_cache_scheme.strategy 'channel'"),
                          ({"dynamic": True}, r"kv_cache_scheme.dynamic True"),
                          ({"num_bits": 4, "type": "int"}, r"kv_cache_scheme.num_bits 4, kv_cache_scheme.type 'int'")):
        with pytest.raises(CheckpointError, match=match):
            engine(kv_scaled_checkpoint(hf, tmp_path / "bad", {i: (0.5, 0.5) for i in ATTENTION}, {**KV_SCHEME, **change}))
    with pytest.raises(CheckpointError, match=rf"model.layers.{ATTENTION[1]}.self_attn.k_scale is missing"):
        engine(kv_scaled_checkpoint(hf, tmp_path / "missing", {ATTENTION[0]: (0.5, 0.5)}))
    with pytest.raises(CheckpointError, match=rf"layers.{ATTENTION[0]}.mixer.v_scale \(the checkpoint's self_attn.v_scale "
                       r"of that layer\) is 0.0: an FP8 KV cache scale must be finite and positive"):
        engine(kv_scaled_checkpoint(hf, tmp_path / "zero", {i: (0.5, 0.0) for i in ATTENTION}))
    eng = engine(kv_scaled_checkpoint(hf, tmp_path / "ok", {i: (0.5, 0.5) for i in ATTENTION}))
    name = f"model.layers.{ATTENTION[0]}.self_attn.k_scale"
    with pytest.raises(CheckpointError, match=f"{name}: the FP8 KV cache's k/v scales are fixed at load"):
        eng.update_weights({name: torch.tensor([0.25])})
    assert scales_of(eng)[0] == (0.5, 0.5)


def test_an_attention_impl_without_kv_scales_is_refused(hf, tmp_path, monkeypatch):
    """A backend (a third-party one, say) whose attention takes no ``kv_scales`` is refused at
    build, naming it, rather than failing at the first step or ignoring the scales."""
    path = kv_scaled_checkpoint(hf, tmp_path / "ct", {i: (0.5, 0.5) for i in ATTENTION})

    def forward(self, qkv, q_norm, k_norm, k_cache, v_cache, ctx):
        raise AssertionError("never called")

    monkeypatch.setattr(reference_attention.ReferenceAttentionImpl, "forward", forward)
    with pytest.raises(BackendSelectionError, match="ReferenceAttentionImpl: its forward takes no kv_scales"):
        engine(path)


def test_explain_names_the_scales(hf, tmp_path):
    """``explain`` (which builds no impl) plans a kv-scaled checkpoint and says it holds scales."""
    from bi_core.runtime.build import explain

    path = kv_scaled_checkpoint(hf, tmp_path / "ct", {i: (0.5, 0.5) for i in ATTENTION})
    cfg = EngineConfig.from_dict({"model": {"path": str(path), "dtype": "bfloat16", "device": "cuda"},
                                  "backend": "cuda_hopper_invariant", "policy": {"batch_invariant": True},
                                  "cache": {"block_size": 16, "num_blocks": 64, "kv_cache_dtype": "fp8"}})
    assert "the checkpoint's calibrated k/v scales (one per layer) for an FP8 KV cache" in explain(cfg)


def test_two_ranks_read_the_scales(hf, tmp_path):
    """Under tensor parallelism each rank holds every scale of its layers (one per layer, not
    split): two gloo ranks score as one rank does, up to an FP8 rounding boundary crossed in the
    other summation order (as tests/quant/test_fp8_tp.py), where ranks at scale 1 would not."""
    path = kv_scaled_checkpoint(hf, tmp_path / "ct", {ATTENTION[0]: (0.37, 2.9), ATTENTION[1]: (0.05, 0.6)})
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 60)), [5], [40, 41, 42, 43], [7, 7], [3] * 6, [90] * 5]
    params = SamplingParams(max_new_tokens=4, logprobs=1)

    def config(tp):
        return EngineConfig.from_dict({
            "model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}, "parallel": {"tensor_parallel_size": tp},
            "cache": {"block_size": 16, "num_blocks": 64, "kv_cache_dtype": "fp8"}})

    one = build_engine(config(1)).generate(prompts, params)
    eng = build_engine(config(2))
    try:
        two = eng.generate(prompts, params)
    finally:
        eng.close()
    close = [abs(a.token_logprobs[0] - b.token_logprobs[0]) < 1e-3 for a, b in zip(one, two)]
    assert sum(close) >= 4, [(a.token_logprobs, b.token_logprobs) for a, b in zip(one, two)]
