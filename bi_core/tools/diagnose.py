"""Which op first makes a request's bits depend on the batch: prefill and decode probes for ``verify``.

Probes run the engine's own model on pages and state slots borrowed from the cache (returned
after). The prefill probe prefills the prompt alone and as the first sequence of a step packed
with fillers; the decode probe prefills the prompt twice (two copies, each alone, so both start
from the same bits) and runs one decode step for each copy, alone and packed with the fillers'
decode rows. Forward hooks record every op-carrying module's output rows for the prompt, then
its lm_head row and sampler logprob; the first, in execution order, whose values differ bitwise
names the op class."""

from __future__ import annotations

import torch

from bi_core.models import qwen3_5 as m
from bi_core.ops.activation import dense
from bi_core.ops.sampling import SamplingBatch
from bi_core.policies.apply import applied
from bi_core.runtime.batch import build_context

OP_CLASS = (
    (m.Attention, "attention"), (m.GatedDeltaNet, "gdn"), (m.SparseMoE, "moe"), (m.MLP, "linear (MLP)"),
    (m.Linear, "linear"), (m.RMSNorm, "norm"),
)


def _op_class(module: torch.nn.Module) -> str | None:
    return next((name for cls, name in OP_CLASS if isinstance(module, cls)), None)


def _record(model: torch.nn.Module, rows: int, into: list) -> list:
    def hook(module, args, output, name):
        out = dense(output[0] if isinstance(output, tuple) else output)  # a norm's FP8 copy follows its rows
        into.append((name, _op_class(module), out[:rows].detach().clone()))

    return [mod.register_forward_hook(lambda mo, a, o, n=name: hook(mo, a, o, n))
            for name, mod in model.named_modules()
            if _op_class(mod) is not None and not name.startswith("mtp") and name != "lm_head"]


class _Borrowed:
    """Pages and state slots for ``lengths`` tokens per sequence, given back on exit."""

    def __init__(self, cache, lengths: list[int]) -> None:
        self.cache, self.lengths = cache, lengths

    def __enter__(self) -> tuple[list[list[int]], list[int]]:
        cache, need = self.cache, [self.cache.blocks_for(n) for n in self.lengths]
        if sum(need) > cache.blocks.num_free or len(cache.slots.free) < len(need):
            raise RuntimeError("not enough free pages or slots for the probe")
        self.blocks = [cache.blocks.allocate(n) for n in need]
        self.slots = [cache.slots.allocate() for _ in need]
        return self.blocks, self.slots

    def __exit__(self, *exc) -> None:
        for b in self.blocks:
            self.cache.blocks.release(b)
        for s in self.slots:
            self.cache.slots.release(s)


def _forward(engine, tokens: list[list[int]], past: list[int], blocks, slots, *, record: bool) -> list:
    """One model step over ``tokens`` (sequence 0 is the probed one); with ``record``, every op's
    output rows for sequence 0, then its lm_head row and sampler logprob."""
    cache, recorded = engine.cache, []
    recurrent = [len(t) == 1 and p > 0 for t, p in zip(tokens, past)]
    handles = _record(engine.model, len(tokens[0]), recorded) if record else []
    try:
        ids, ctx = build_context(tokens, past, blocks, slots, recurrent, block_size=cache.block_size,
                                 device=engine.device, ring=cache.state_ring)
        with torch.inference_mode(), applied(engine.policy):  # the settings engine steps run under
            engine.model.prepare_step(ctx)
            _, logits = engine.model(ids, ctx, cache.main)
            if not record:
                return recorded
            # then the rest of the path to a logprob: lm_head over the last rows, the sampler
            recorded.append(("lm_head", "linear", logits[:1].clone()))
            n = len(tokens)
            batch = SamplingBatch(temperatures=[0.0] * n, top_ks=[0] * n, top_ps=[1.0] * n, keys=[0] * n,
                                  num_logprobs=0)
            recorded.append(("sampler", "sampling", engine.model.sampler.forward(logits, batch).logprobs[:1].clone()))
    finally:
        for h in handles:
            h.remove()
    return recorded


def _first_difference(alone: list, packed: list) -> str | None:
    for (name, op, a), (_, _, b) in zip(alone, packed):
        if not torch.equal(a, b):
            return f"{op} at {name}"
    return None


def first_divergent_op(engine, prompt: list[int], fillers: list[list[int]]) -> str | None:
    """``"<op class> at <module>"`` for the first module whose output rows for ``prompt`` differ
    between a prefill alone and one packed with ``fillers``; None if none differ."""
    seqs = [prompt] + fillers
    with _Borrowed(engine.cache, [len(prompt)]) as (blocks, slots):
        alone = _forward(engine, [prompt], [0], blocks, slots, record=True)
    with _Borrowed(engine.cache, [len(p) for p in seqs]) as (blocks, slots):
        packed = _forward(engine, seqs, [0] * len(seqs), blocks, slots, record=True)
    return _first_difference(alone, packed)


def first_divergent_decode_op(engine, prompt: list[int], fillers: list[list[int]]) -> str | None:
    """The same for one decode step after ``prompt``: alone, and packed with one decode row of
    each filler (every sequence prefilled alone first)."""
    seqs = [prompt, prompt] + fillers
    with _Borrowed(engine.cache, [len(p) + 1 for p in seqs]) as (blocks, slots):
        for i, p in enumerate(seqs):
            _forward(engine, [p], [0], blocks[i:i + 1], slots[i:i + 1], record=False)
        nxt = [[p[-1]] for p in seqs]
        alone = _forward(engine, nxt[:1], [len(prompt)], blocks[:1], slots[:1], record=True)
        packed = _forward(engine, nxt[1:], [len(p) for p in seqs[1:]], blocks[1:], slots[1:], record=True)
    return _first_difference(alone, packed)
