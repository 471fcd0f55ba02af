"""Per-row LoRA (bi_core/kernels/lora.py, backends/reference/lora.py): a row's delta is the same
bits alone and among rows of other adapters and none; a whole engine on the Triton kernels gives a
request with an adapter the same logits, tokens and logprobs alone and in a mixed batch (G1)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from triton_anywhere import RERUN_GRAPHS, TritonAnywhere

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.backends.reference.lora import ReferenceLoraImpl
from bi_core.plugins import load_registry

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_fixtures import random_adapter  # noqa: E402


def stacks(k: int, n: int, r: int, slots: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    a = (torch.randn(slots, r, k, generator=gen) / k ** 0.5).to(dtype)
    b = (torch.randn(slots, n, r, generator=gen) / r ** 0.5).to(dtype)
    return a, b


def apply_triton(y, x, a, b, slots):
    from bi_core.kernels.lora import lora_apply

    return lora_apply(y.clone(), x, a, b, slots)


def apply_reference(y, x, a, b, slots):
    return ReferenceLoraImpl().forward(y.clone(), x, a, b, slots)


@pytest.mark.parametrize("apply", [apply_triton, apply_reference], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_alone_equals_row_in_a_mixed_batch(device, apply, dtype):
    """Row 0 (slot 2) alone and among 12 rows of slots 0..3 and -1 (rank padded, K past a block):
    bitwise; slot -1 rows untouched; close to the float32 math; another adapter's row differs."""
    gen = torch.Generator().manual_seed(0)
    k, n, r = 200, 96, 24
    a, b = (t.to(device) for t in stacks(k, n, r, 4, dtype, gen))
    x = torch.randn(13, k, generator=gen).to(dtype).to(device)
    y = torch.randn(13, n, generator=gen).to(dtype).to(device)
    slots = torch.tensor([2, 0, -1, 3, 2, 1, -1, 0, 3, 3, 1, -1, 2], device=device)
    mixed = apply(y, x, a, b, slots)
    alone = apply(y[:1], x[:1], a, b, slots[:1])
    assert torch.equal(mixed[:1], alone)
    assert torch.equal(mixed[slots == -1], y[slots == -1])
    want = y.float() + torch.stack([x[t].float() @ a[s].float().T @ b[s].float().T if s >= 0 else torch.zeros(n)
                                    for t, s in enumerate(slots.tolist())])
    torch.testing.assert_close(mixed.float(), want, atol=3e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    other = apply(y[:1], x[:1], a, b, torch.tensor([1], device=device))
    assert not torch.equal(other, alone)  # the comparison sees a change of adapter


def test_kernel_blocks_change_the_bits(device):
    """Negative control for the test above: the same rows through the kernel at another BLOCK_K (what a
    kernel that picked its blocks from the batch would do) differ in the last bits, so a
    batch-dependent arithmetic would not pass it."""
    from bi_core.kernels import lora as kl

    gen = torch.Generator().manual_seed(1)
    k, n, r = 512, 64, 16
    a, _ = (t.to(device) for t in stacks(k, n, r, 2, torch.float32, gen))
    x = torch.randn(8, k, generator=gen).to(device)
    slots = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1], device=device)
    fixed = kl.lora_rows(x, a, slots)
    other = torch.empty_like(fixed)
    kl._lora_rows_kernel[(8, 1)](x, a, slots, other, slots, k, r, k, x.stride(0), a.stride(0), a.stride(1),
                                 other.stride(0), ADD=False, RANKED=0, BLOCK_N=16, BLOCK_K=32)
    torch.testing.assert_close(other, fixed)
    assert not torch.equal(other, fixed)


def lora_config(device, *, max_loras: int = 4, experts: bool = False):
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "tiny-moe", "seed": 5, "num_hidden_layers": 2}, "device": device.type,
               "max_model_len": 128},
        backend="triton_anywhere", graph=RERUN_GRAPHS, strategy={"name": "ar"},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 32},
        lora={"max_loras": max_loras, "max_rank": 16, "experts": experts}))


def load_adapters(engine) -> None:
    for name, r, seed in (("a", 8, 1), ("b", 16, 2), ("c", 4, 3)):
        cfg, tensors = random_adapter(engine, r=r, seed=seed)
        engine.load_lora_adapter(name, tensors=tensors, config=cfg)


@pytest.mark.usefixtures("ordered_dot")
def test_adapter_request_alone_and_in_a_mixed_batch_bitwise(device):
    """A needle with adapter "a" (seeded sampling) alone, and among requests on adapters "b", "c"
    and none: the same tokens, logprobs and last-prompt-row logits. Negative control: the needle
    on adapter "b" has other logits (the adapter reaches the bits compared)."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    gen = torch.Generator().manual_seed(11)
    needle, *others = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (20, 9, 41, 4)]
    at = random.Random(3).randrange(len(others) + 1)
    hot = SamplingParams(max_new_tokens=3, temperature=0.8, seed=1234, ignore_eos=True, logprobs=1, lora_name="a")
    rest = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=1, lora_name=lo)
            for n, lo in ((2, "b"), (4, None), (3, "c"))]

    def run(prompts, params):
        eng, seen = build_engine(lora_config(device), registry), []
        load_adapters(eng)
        eng.runner.on_logits = lambda seqs, logits: seen.extend(
            logits[i].clone() for i, q in enumerate(seqs) if q.prompt_ids == needle and not q.output_ids)
        outs = eng.generate(prompts, params)
        assert eng.runner.main_graphs.num_replays[1] > 0  # decode steps replayed graph buffers
        return outs, seen[0]

    (alone,), alone_row = run([needle], [hot])
    batch, batch_row = run(others[:at] + [needle] + others[at:], rest[:at] + [hot] + rest[at:])
    assert torch.equal(batch_row, alone_row)
    assert batch[at].token_ids == alone.token_ids
    assert batch[at].token_logprobs == alone.token_logprobs and batch[at].logprobs == alone.logprobs
    _, swapped = run([needle], [attrs_evolve(hot, lora_name="b")])
    assert not torch.equal(swapped, alone_row)


def attrs_evolve(params, **kw):
    import attrs

    return attrs.evolve(params, **kw)


def test_skipping_a_slots_padding_changes_no_bit(device):
    """``ranks``: slot s reads only its first ranks[s] columns of each part (the others are zero):
    the same bits as reading the zeros, bf16; and the mask bites (a rank too small differs)."""
    from bi_core.kernels.lora import lora_apply

    gen = torch.Generator().manual_seed(2)
    k, n, part, parts = 96, 80, 16, 3
    a, b = stacks(k, n, part * parts, 3, torch.bfloat16, gen)
    used = [4, 16, 9]
    for s, r in enumerate(used):  # zero each slot's padding columns in every part
        for p in range(parts):
            a[s, p * part + r:(p + 1) * part] = 0
            b[s, :, p * part + r:(p + 1) * part] = 0
    a, b = a.to(device), b.to(device)
    x = torch.randn(7, k, generator=gen).to(torch.bfloat16).to(device)
    y = torch.randn(7, n, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.tensor([0, 2, -1, 1, 0, 2, 1], device=device)
    ranks = torch.tensor(used, dtype=torch.int32, device=device)
    full = lora_apply(y.clone(), x, a, b, slots)
    assert torch.equal(lora_apply(y.clone(), x, a, b, slots, ranks, part), full)
    short = torch.tensor([4, 8, 9], dtype=torch.int32, device=device)
    assert not torch.equal(lora_apply(y.clone(), x, a, b, slots, short, part), full)
