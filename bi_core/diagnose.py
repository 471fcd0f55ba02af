"""Which op first makes a request's bits depend on the batch: a prefill probe for ``verify``.

The prompt is prefilled twice through the engine's own model, alone and as the first sequence of
a step packed with fillers, on pages and state slots borrowed from the cache and returned after.
Forward hooks record every op-carrying module's output rows for the prompt, then its lm_head row
and sampler logprob; the first, in execution order, whose values differ bitwise names the op class."""

from __future__ import annotations

import torch

from bi_core.models import qwen3_5 as m
from bi_core.ops.sampling import SamplingBatch
from bi_core.runtime.batch import build_context

OP_CLASS = (
    (m.Attention, "attention"), (m.GatedDeltaNet, "gdn"), (m.SparseMoE, "moe"), (m.MLP, "linear (MLP)"),
    (m.Linear, "linear"), (m.RMSNorm, "norm"),
)


def _op_class(module: torch.nn.Module) -> str | None:
    return next((name for cls, name in OP_CLASS if isinstance(module, cls)), None)


def _record(model: torch.nn.Module, rows: int, into: list) -> list:
    def hook(module, args, output, name):
        out = output[0] if isinstance(output, tuple) else output
        into.append((name, _op_class(module), out[:rows].detach().clone()))

    return [mod.register_forward_hook(lambda mo, a, o, n=name: hook(mo, a, o, n))
            for name, mod in model.named_modules()
            if _op_class(mod) is not None and not name.startswith("mtp") and name != "lm_head"]


def _prefill(engine, prompts: list[list[int]]) -> list:
    cache, recorded = engine.cache, []
    need = [cache.blocks_for(len(p)) for p in prompts]
    if sum(need) > cache.blocks.num_free or len(cache.slots.free) < len(prompts):
        raise RuntimeError("not enough free pages or slots for the probe")
    blocks = [cache.blocks.allocate(n) for n in need]
    slots = [cache.slots.allocate() for _ in prompts]
    handles = _record(engine.model, len(prompts[0]), recorded)
    try:
        ids, ctx = build_context(prompts, [0] * len(prompts), blocks, slots, [False] * len(prompts),
                                 block_size=cache.block_size, device=engine.device, ring=cache.state_ring)
        with torch.inference_mode():
            engine.model.prepare_step(ctx)
            hidden = engine.model(ids, ctx, cache.main)
            # then the rest of the path to a logprob: lm_head over the sampled rows, the sampler
            logits = engine.model.compute_logits(hidden[ctx.logits_indices])
            recorded.append(("lm_head", "linear", logits[:1].clone()))
            n = len(prompts)
            batch = SamplingBatch(temperatures=[0.0] * n, top_ks=[0] * n, top_ps=[1.0] * n, keys=[0] * n,
                                  num_logprobs=0)
            recorded.append(("sampler", "sampling", engine.model.sampler.forward(logits, batch).logprobs[:1].clone()))
    finally:
        for h in handles:
            h.remove()
        for b in blocks:
            cache.blocks.release(b)
        for s in slots:
            cache.slots.release(s)
    return recorded


def first_divergent_op(engine, prompt: list[int], fillers: list[list[int]]) -> str | None:
    """``"<op class> at <module>"`` for the first module whose output rows for ``prompt`` differ
    between a prefill alone and one packed with ``fillers``; None if none differ."""
    alone = _prefill(engine, [prompt])
    packed = _prefill(engine, [prompt] + fillers)
    for (name, op, a), (_, _, b) in zip(alone, packed):
        if not torch.equal(a, b):
            return f"{op} at {name}"
    return None
