"""A structured output's grammar mask in the sampler: the invariant backend's (Triton, interpreted
on the CPU) and the reference one. Rows with masks (greedy, seeded, with top-k, with penalties,
with masked logprobs) beside plain rows draw only allowed tokens, and a row's token, logprob and
top-N are the same bits alone, in the batch and permuted. Negative controls: one mask for the whole
batch (the first masked row's) makes a row follow its batch, and the same check sees it; a mask
not applied draws forbidden tokens. Then the whole Triton engine: a JSON-schema needle alone and
among unconstrained and other-constrained requests (G1), drawn by the row-by-row sampler (top-N
logprobs) and with its masks on the device, the same bits both ways, and a negative control."""

from __future__ import annotations

import pytest
import torch
from test_engine_triton import TritonAnywhere, needle_config

from bi_core import SamplingParams, build_engine
from bi_core.backends.cuda_common.sampling import CudaSamplerImpl
from bi_core.backends.reference.sampling import ReferenceSamplerImpl
from bi_core.ops.sampling import LogitsAdjust, SamplingBatch, mix_seed
from bi_core.plugins import load_registry
from bi_core.runtime import runner as runner_module
from bi_core.structured import json_schema, regex

VOCAB, NUM_LOGPROBS = 10000, 3  # two of the kernel's 8192-token vocabulary chunks

# per row: temperature, top_k, masked (a grammar), penalties, masked logprobs
ROWS = [
    (0.0, 0, True, False, False),
    (0.8, 0, True, False, False),
    (0.0, 0, False, False, False),
    (1.0, 50, True, False, True),
    (0.7, 0, False, False, False),
    (0.9, 0, True, True, True),
]


def bitmask_of(allowed: torch.Tensor) -> torch.Tensor:
    """``[V]`` booleans as the int32 bitmask ``LogitsAdjust.allowed`` takes (bit t % 32 of word t // 32)."""
    words = (allowed.shape[0] + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.shape[0]] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def peaked_logits(device, dtype=torch.float32) -> torch.Tensor:
    logits = 2 * torch.randn(len(ROWS), VOCAB, device=device)
    hot = torch.randperm(VOCAB, device=device)[:8]
    logits[:, hot] += 6 + 2 * torch.rand(len(ROWS), 8, device=device)
    return logits.to(dtype)


def masks_for(logits: torch.Tensor) -> list[torch.Tensor | None]:
    """Per masked row: a mask that forbids its own top tokens and allows 200 random others plus a
    few of the rows' hot ones, so the mask decides what it draws; each row's mask is its own."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i, (_, _, is_masked, _, _) in enumerate(ROWS):
        if not is_masked:
            out.append(None)
            continue
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[torch.randperm(VOCAB, generator=gen)[:200]] = True
        top = torch.topk(logits[i].float().cpu(), 8).indices
        allowed[top[3 + i % 3:]] = True  # a few hot tokens stay allowed, the row's top three never
        allowed[top[:3]] = False
        out.append(bitmask_of(allowed))
    return out


def adjustments(logits, masks) -> list[LogitsAdjust | None]:
    out = []
    for (_, _, _, penalized, _), mask in zip(ROWS, masks):
        if mask is None and not penalized:
            out.append(None)
            continue
        out.append(LogitsAdjust(allowed=mask, output_ids=[1, 2, 2] if penalized else [],
                                frequency_penalty=0.7 if penalized else 0.0))
    return out


def batch_of(rows: list[int], adjust: list, leaky: bool = False, unmasked: bool = False) -> SamplingBatch:
    picked = [adjust[i] for i in rows]
    if leaky:  # the batch's first mask for every masked row: what the negative control must catch
        first = next((a.allowed for a in picked if a is not None and a.allowed is not None), None)
        picked = [a if a is None or a.allowed is None else LogitsAdjust(allowed=first, output_ids=a.output_ids,
                                                                         frequency_penalty=a.frequency_penalty)
                  for a in picked]
    if unmasked:
        picked = [None for _ in picked]
    masked = [ROWS[i][4] and picked[k] is not None and picked[k].allowed is not None for k, i in enumerate(rows)]
    return SamplingBatch(temperatures=[ROWS[i][0] for i in rows], top_ks=[ROWS[i][1] for i in rows],
                         top_ps=[1.0] * len(rows), keys=[mix_seed(500 + i, 9) for i in rows], num_logprobs=NUM_LOGPROBS,
                         adjust=picked if any(a is not None for a in picked) else None,
                         masked_logprobs=masked if any(masked) else None)


def outputs(sampler, logits, adjust, rows, **kw) -> list[torch.Tensor]:
    out = sampler.forward(logits[rows], batch_of(rows, adjust, **kw))
    return [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]


def mismatches(sampler, logits, adjust, **kw) -> list[str]:
    n = len(ROWS)
    whole = outputs(sampler, logits, adjust, list(range(n)), **kw)
    bad = []
    for i in range(n):
        alone = outputs(sampler, logits, adjust, [i], **kw)
        bad += [f"row {i} alone, output {k}" for k, (a, b) in enumerate(zip(alone, whole)) if not torch.equal(a[0], b[i])]
    perm = [3, 5, 0, 4, 1, 2]
    shuffled = outputs(sampler, logits, adjust, perm, **kw)
    bad += [f"permuted, output {k}" for k, (a, b) in enumerate(zip(shuffled, whole)) if not torch.equal(a, b[perm])]
    return bad


def allowed_bit(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


SAMPLERS = {"triton": CudaSamplerImpl, "reference": ReferenceSamplerImpl}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_masked_rows_draw_allowed_tokens_and_are_row_invariant(device, dtype, name):
    torch.manual_seed(5)
    logits = peaked_logits(device, dtype)
    masks = masks_for(logits)
    adjust, sampler = adjustments(logits, masks), SAMPLERS[name]()
    assert mismatches(sampler, logits, adjust) == []
    tokens, logprobs, top_ids, top_lps = outputs(sampler, logits, adjust, list(range(len(ROWS))))
    for i, mask in enumerate(masks):
        if mask is not None:
            assert allowed_bit(mask, int(tokens[i]))
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, (_, _, _, _, masked_lp) in enumerate(ROWS):
        if masked_lp:  # the distribution over the allowed tokens: what masked_logprobs reports, top-N too
            keep = torch.tensor([allowed_bit(masks[i], t) for t in range(VOCAB)], device=logits.device)
            want = torch.log_softmax(logits[i].float().masked_fill(~keep, float("-inf")), dim=-1)
            torch.testing.assert_close(logprobs[i], want[tokens[i]], atol=1e-5, rtol=0)
            assert all(allowed_bit(masks[i], int(t)) for t in top_ids[i])
        else:  # raw by default, masked or not
            torch.testing.assert_close(logprobs[i], raw[i, tokens[i]], atol=1e-5, rtol=0)
            assert torch.equal(top_ids[i], torch.topk(raw[i], NUM_LOGPROBS).indices)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_negative_controls_one_mask_for_the_batch_and_no_mask(device, name):
    torch.manual_seed(6)
    logits = peaked_logits(device)
    masks = masks_for(logits)
    adjust, sampler = adjustments(logits, masks), SAMPLERS[name]()
    assert mismatches(sampler, logits, adjust, leaky=True)
    tokens = outputs(sampler, logits, adjust, list(range(len(ROWS))), unmasked=True)[0]
    assert any(mask is not None and not allowed_bit(mask, int(tokens[i])) for i, mask in enumerate(masks))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["ab", "cd", "ef"]}}, "required": ["n", "tag"]}


def _needle_runs(device, logprobs: int | None = 2, masked_rows: list | None = None):
    """The needle alone and among others; ``logprobs=None`` (and the others without top-N
    logprobs): its rows are drawn on the device with their masks (``masked_rows`` gets each
    engine's count), else by the row-by-row sampler."""
    gen = torch.Generator().manual_seed(23)
    needle, *others = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (20, 9, 30, 4)]
    hot = SamplingParams(max_new_tokens=40, temperature=0.8, seed=41, logprobs=logprobs,
                         structured=json_schema(SCHEMA, any_whitespace=False))
    rest = [SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=1 if logprobs else None),
            SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, structured=regex(r"[a-z]{3,9}")),
            SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, structured=json_schema(SCHEMA))]
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    engines = [build_engine(needle_config(device, 32), registry) for _ in range(2)]
    (alone,) = engines[0].generate([needle], [hot])
    batch = engines[1].generate([others[0], others[1], needle, others[2]], [rest[0], rest[1], hot, rest[2]])
    if masked_rows is not None:
        masked_rows += [e.runner.num_masked_rows for e in engines]
    return alone, batch[2]


@pytest.mark.usefixtures("ordered_dot")
def test_json_schema_needle_alone_and_in_a_batch_bitwise(device, monkeypatch):
    """The needle (a JSON schema, seeded sampling) after an unconstrained request and a regex one,
    beside another with the same schema, on the Triton engine: the same tokens, logprobs and top
    logprobs as alone (float equality), and valid JSON. Negative control: every constrained row of
    a step masked with the step's first constrained row's mask (the regex request's): the needle
    no longer matches."""
    import json

    alone, needle = _needle_runs(device)
    assert needle.token_ids == alone.token_ids and needle.finish_reason == alone.finish_reason == "stop"
    assert needle.token_logprobs == alone.token_logprobs and needle.logprobs == alone.logprobs
    assert set(json.loads(alone.text)) == {"n", "tag"}

    real = runner_module.sampling_batch

    def one_mask_a_step(*args, **kwargs):
        batch = real(*args, **kwargs)
        masks = [a.allowed for a in batch.adjust or () if a is not None and a.allowed is not None]
        for a in batch.adjust or ():
            if a is not None and a.allowed is not None:
                a.allowed = masks[0]
        return batch

    monkeypatch.setattr(runner_module, "sampling_batch", one_mask_a_step)
    leaky_alone, leaky = _needle_runs(device)
    assert leaky_alone.token_ids == alone.token_ids and leaky.token_ids != alone.token_ids


@pytest.mark.usefixtures("ordered_dot")
def test_json_schema_needle_masked_on_the_device_alone_and_in_a_batch_bitwise(device):
    """The needle without top-N logprobs, beside requests without them: its rows are drawn on
    the device with their masks (the batched sampler, after the step's graph), the same tokens
    and logprobs alone and in the batch, and the same as the row-by-row sampler's (the needle with
    top-N logprobs: the test above). Negative control: that test's leaky run."""
    counts: list[int] = []
    alone, needle = _needle_runs(device, logprobs=None, masked_rows=counts)
    assert min(counts) >= len(alone.token_ids)
    assert needle.token_ids == alone.token_ids and needle.token_logprobs == alone.token_logprobs
    row_by_row, _ = _needle_runs(device)
    assert row_by_row.token_ids == alone.token_ids and row_by_row.token_logprobs == alone.token_logprobs
