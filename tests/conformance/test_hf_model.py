"""The engine (reference backend, float32) against transformers' own Qwen3.5 classes."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import hf_greedy, make_hf_model, save_checkpoint

from bi_core import EngineConfig, SamplingParams, build_engine

PROMPT_LENS = (5, 17, 70, 1, 33)  # 70 crosses a 64-token GDN chunk
STEPS = 16

CASES = [
    # kind, tie, layout, experts, shards, with_mtp
    pytest.param("dense", False, "text", "per_expert", 1, False, id="dense-text-untied"),
    pytest.param("dense", True, "multimodal", "per_expert", 2, True, id="dense-multimodal-tied-sharded-mtp"),
    pytest.param("moe", False, "text", "per_expert", 1, False, id="moe-text-per-expert"),
    pytest.param("moe", False, "multimodal", "fused", 1, True, id="moe-multimodal-fused-mtp"),
    pytest.param("moe", True, "text", "fused_transposed", 3, False, id="moe-text-transposed-tied"),
]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_engine(path, chunk: int | None = None):
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 128, "prefill_chunk_size": chunk},
           "cache": {"block_size": 16, "num_blocks": 128}}
    engine = build_engine(EngineConfig.from_dict(cfg))
    first_logits: dict[int, torch.Tensor] = {}

    def observe(seqs, logits):
        for s, row in zip(seqs, logits):
            if not s.output_ids:
                first_logits[s.request_id] = row.float().clone()

    engine.on_logits = observe
    out = engine.generate(prompts(300), SamplingParams(max_new_tokens=STEPS, ignore_eos=True, logprobs=3))
    return out, [first_logits[o.request_id] for o in out]


@pytest.mark.parametrize("kind,tie,layout,experts,shards,with_mtp", CASES)
def test_matches_transformers(tmp_path, kind, tie, layout, experts, shards, with_mtp):
    hf = make_hf_model(kind, tie=tie)
    path = save_checkpoint(hf, tmp_path / "ckpt", layout=layout, experts=experts, with_mtp=with_mtp, shards=shards)
    outs, logits = run_engine(path)
    for prompt, out, ours in zip(prompts(300), outs, logits):
        tokens, logprobs, first = hf_greedy(hf, prompt, STEPS)
        assert rel_err(ours, first) < 1e-4
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(out.token_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
        assert all(out.token_ids[i] in out.logprobs[i] for i in range(STEPS))


def test_save_pretrained_checkpoint_and_chunked_prefill(tmp_path):
    """A checkpoint written by transformers' own save_pretrained, prefilled in 16-token chunks."""
    hf = make_hf_model("moe", seed=3)
    hf.save_pretrained(tmp_path / "ckpt")
    outs, logits = run_engine(tmp_path / "ckpt", chunk=16)
    for prompt, out, ours in zip(prompts(300), outs, logits):
        tokens, logprobs, first = hf_greedy(hf, prompt, STEPS)
        assert rel_err(ours, first) < 1e-4
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.token_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
