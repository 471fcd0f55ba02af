"""The invariant backend's sampler (Triton, interpreted on the CPU) and the reference sampler with
penalties, min_tokens' mask and min-p beside top-k/top-p and plain rows: a row's token, logprob
and top-N are the same bits alone, in a batch of rows with other parameters, and permuted.
Negative control: a batch-wide setting (every penalized row adjusted as the batch's first one)
makes a row follow its batch, and the same check sees it. Then the whole engine: a needle request
with penalties, min_p and min_tokens alone and among requests with other parameters (G1)."""

from __future__ import annotations

import pytest
import torch
from test_engine_triton import TritonAnywhere, needle_config

from bi_core import SamplingParams, build_engine
from bi_core.backends.cuda_common.sampling import CudaSamplerImpl
from bi_core.backends.reference.sampling import ReferenceSamplerImpl
from bi_core.ops.sampling import LogitsAdjust, SamplingBatch, mix_seed
from bi_core.plugins import load_registry

VOCAB, NUM_LOGPROBS = 10000, 3  # two of the kernel's 8192-token vocabulary chunks

# per row: temperature, top_k, top_p, min_p, adjust (None: a plain row)
ROWS = [
    (0.0, 0, 1.0, 0.0, None),
    (0.0, 0, 1.0, 0.0, "banned+repetition"),
    (0.8, 0, 1.0, 0.0, "frequency+presence"),
    (1.0, 50, 1.0, 0.05, None),
    (0.7, 0, 1.0, 0.0, None),
    (0.9, 0, 0.9, 0.02, "all"),
]


def peaked_logits(device, dtype=torch.float32) -> torch.Tensor:
    """Random rows with the same 8 tokens far above the rest, as a model's common tokens are (so
    draws land among them, and a row's penalties and its neighbours' touch the same tokens)."""
    logits = 2 * torch.randn(len(ROWS), VOCAB, device=device)
    hot = torch.randperm(VOCAB, device=device)[:8]
    logits[:, hot] += 6 + 2 * torch.rand(len(ROWS), 8, device=device)
    return logits.to(dtype)


def adjustments(logits: torch.Tensor) -> list[LogitsAdjust | None]:
    """Penalties on each row's own top tokens, so they change what it draws."""
    out = []
    for i, (_, _, _, _, kind) in enumerate(ROWS):
        top = torch.topk(logits[i].float(), 8).indices.tolist()
        out.append(None if kind is None else LogitsAdjust(
            banned=tuple(top[:2]) if kind in ("banned+repetition", "all") else (),
            seen_ids=top + [5, 6], output_ids=top[:5] * 2 + [7],
            repetition_penalty=1.8 if kind in ("banned+repetition", "all") else 1.0,
            frequency_penalty=0.7 if kind in ("frequency+presence", "all") else 0.0,
            presence_penalty=1.1 if kind in ("frequency+presence", "all") else 0.0))
    return out


def batch_of(rows: list[int], adjust: list, leaky: bool = False) -> SamplingBatch:
    picked = [adjust[i] for i in rows]
    if leaky:  # one adjustment for the batch (its first penalized row's): what the negative control must catch
        first = next((a for a in picked if a is not None), None)
        picked = [None if a is None else first for a in picked]
    return SamplingBatch(temperatures=[ROWS[i][0] for i in rows], top_ks=[ROWS[i][1] for i in rows],
                         top_ps=[ROWS[i][2] for i in rows], keys=[mix_seed(1000 + i, 17) for i in rows],
                         num_logprobs=NUM_LOGPROBS, min_ps=[ROWS[i][3] for i in rows], adjust=picked)


def outputs(sampler, logits, adjust, rows: list[int], leaky: bool = False) -> list[torch.Tensor]:
    out = sampler.forward(logits[rows], batch_of(rows, adjust, leaky))
    return [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]


def mismatches(sampler, logits, adjust, leaky: bool = False) -> list[str]:
    n = len(ROWS)
    whole = outputs(sampler, logits, adjust, list(range(n)), leaky)
    bad = []
    for i in range(n):
        alone = outputs(sampler, logits, adjust, [i], leaky)
        bad += [f"row {i} alone, output {k}" for k, (a, b) in enumerate(zip(alone, whole)) if not torch.equal(a[0], b[i])]
    perm = [3, 5, 0, 4, 1, 2]
    shuffled = outputs(sampler, logits, adjust, perm, leaky)
    bad += [f"permuted, output {k}" for k, (a, b) in enumerate(zip(shuffled, whole)) if not torch.equal(a, b[perm])]
    return bad


SAMPLERS = {"triton": CudaSamplerImpl, "reference": ReferenceSamplerImpl}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_rows_with_penalties_min_p_and_min_tokens_are_row_invariant(device, dtype, name):
    torch.manual_seed(3)
    logits = peaked_logits(device, dtype)
    adjust, sampler = adjustments(logits), SAMPLERS[name]()
    assert mismatches(sampler, logits, adjust) == []
    # the adjustments decide tokens (the check compares something they change) and leave logprobs raw
    plain = outputs(sampler, logits, [None] * len(ROWS), list(range(len(ROWS))))
    adjusted = outputs(sampler, logits, adjust, list(range(len(ROWS))))
    assert adjusted[0][1] != plain[0][1] and (adjusted[0][[2, 5]] != plain[0][[2, 5]]).any()
    raw = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(adjusted[1], raw.gather(1, adjusted[0][:, None])[:, 0], atol=1e-5, rtol=0)
    assert torch.equal(adjusted[2], plain[2]) and torch.equal(adjusted[3], plain[3])


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_negative_control_one_adjustment_for_the_batch(device, name):
    torch.manual_seed(4)
    logits = peaked_logits(device)
    assert mismatches(SAMPLERS[name](), logits, adjustments(logits), leaky=True)


@pytest.mark.usefixtures("ordered_dot")
def test_needle_with_penalties_alone_and_in_a_batch_bitwise(device):
    """The needle (penalties, min_p, min_tokens (its EOS masked), seeded
    sampling) among requests with other penalties and plain ones, on the Triton engine: the same
    tokens, logprobs and top logprobs as alone (float equality)."""
    gen = torch.Generator().manual_seed(21)
    needle, *others = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (20, 9, 30, 4)]
    hot = SamplingParams(max_new_tokens=5, temperature=0.8, seed=99, ignore_eos=True, logprobs=2, min_p=0.05,
                         repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3)
    rest = [SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1, frequency_penalty=-1.0),
            SamplingParams(max_new_tokens=3, temperature=1.0, seed=5, ignore_eos=True, top_k=20),
            SamplingParams(max_new_tokens=5, ignore_eos=True, repetition_penalty=2.0, min_tokens=2)]
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    (alone,) = build_engine(needle_config(device, 32), registry).generate([needle], [hot])
    batch = build_engine(needle_config(device, 32), registry).generate([others[0], needle, *others[1:]],
                                                                      [rest[0], hot, *rest[1:]])
    assert batch[1].token_ids == alone.token_ids and len(alone.token_ids) == 5
    assert batch[1].token_logprobs == alone.token_logprobs and batch[1].logprobs == alone.logprobs
