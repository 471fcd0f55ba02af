"""The trainer's speed: ``PolicyModel``'s parity forward and forward + backward against transformers'
Qwen3.5 (with fla's kernels where installed: the usual trainer path), same weights, same GPU, same
process, sequences of ``--seq-len`` tokens, for several completion lengths (the completion runs in
decode arithmetic: GDN's recurrent form is sequential in time).

    python benchmarks/train_bench.py benchmarks/configs/qwen35b_invariant.yaml --layers 8 \\
        --batch 4 --seq-len 4096 --completions 256,1024,4095 --json $OUT/train_bench.json

Both sides compute the completion tokens' logprobs in blocks of rows (never batch x vocabulary
logits at once) and both checkpoint every layer for the backward (transformers'
``gradient_checkpointing_enable``). Times are the median of ``--steps`` after one warm-up.

transformers' forward + backward runs its own torch chunked GDN by default (``--hf-train-gdn torch``):
fla 0.6's chunked backward refuses Hopper under Triton < 3.7.1 (fla #640), the Triton the GPU image
ships; ``--hf-train-gdn fla`` asks for fla's backward where it runs. Its forward uses fla where
installed. Each row names what ran."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_parity import with_changes  # noqa: E402

from bi_core import EngineConfig  # noqa: E402
from bi_core.runtime import gc_heap  # noqa: E402
from bi_core.train import PolicyModel  # noqa: E402
from bi_core.train.hf import to_transformers  # noqa: E402

BLOCK = 512


def _innermost(fn):
    """The function under transformers' wrappers: ``functools.wraps`` layers, and the ``kernels``
    package's module (a ``Func`` whose forward closes over the wrapped function) where installed."""
    while True:
        if hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif isinstance(fn, torch.nn.Module):
            fwd = type(fn).forward
            cells = dict(zip(fwd.__code__.co_freevars, fwd.__closure__ or ()))
            fn = cells["func"].cell_contents
        else:
            return fn


_said: list[bool] = []


@contextlib.contextmanager
def hf_gdn(model, which: str):
    """transformers' chunked GDN as ``which`` says: "fla" (what it resolved, fla where installed) or
    "torch" (its own implementation). Releases differ in where the choice lives (a module global
    behind a kernel wrapper, a global imported from fla, each GDN module's attribute), so "torch"
    replaces every one of them for the block: the module's globals named ``chunk_gated_delta_rule``
    or ``torch_chunk_gated_delta_rule`` and any module attribute of those names."""
    names = ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")
    # the modules that define the model's classes (qwen3_5_moe for the MoE checkpoints, qwen3_5 for dense)
    defining = {sys.modules[type(mod).__module__] for mod in model.modules()}
    defining = [d for d in defining if hasattr(d, "torch_chunk_gated_delta_rule")]
    m = defining[0]
    saved = [(d, n, getattr(d, n)) for d in defining for n in names if hasattr(d, n)]
    saved += [(mod, n, getattr(mod, n)) for mod in model.modules() for n in names if hasattr(mod, n)]
    if which == "torch":
        torch_fn = _innermost(m.torch_chunk_gated_delta_rule)
        for owner, n, _ in saved:
            setattr(owner, n, torch_fn)
        if not _said:  # once: the log names what transformers' backward ran
            _said.append(True)
            print(f"transformers' forward + backward GDN: {torch_fn.__module__}.{torch_fn.__qualname__} "
                  f"(in place of {sorted({n for _, n, _ in saved})} in {sorted(d.__name__ for d in defining)})", flush=True)
    try:
        yield
    finally:
        for owner, n, fn in saved:
            setattr(owner, n, fn)


def timed(fn, steps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_logprobs(model, ids: torch.Tensor, prompt_len: int, grad: bool) -> torch.Tensor:
    """transformers' completion logprobs: the decoder, then the lm_head and log-softmax in blocks
    (each block checkpointed when training, so no batch-wide logits are kept)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, prompt_len - 1:-1].reshape(-1, model.config.hidden_size)
    targets = ids[:, prompt_len:].reshape(-1)

    def block(h, t):
        return torch.log_softmax(model.lm_head(h).float(), dim=-1).gather(1, t[:, None])[:, 0]
    parts = [checkpoint(block, hidden[a:a + BLOCK], targets[a:a + BLOCK], use_reentrant=False) if grad
             else block(hidden[a:a + BLOCK], targets[a:a + BLOCK]) for a in range(0, hidden.shape[0], BLOCK)]
    return torch.cat(parts)


def measure(policy, hf, prompts, completions, ids, prompt_len: int, steps: int, tokens: int,
            hf_train_gdn: str) -> dict:
    """Each side's forward and forward + backward, timed."""
    def ours_forward():
        with torch.no_grad():
            policy.token_logprobs(prompts, completions)

    def ours_train():
        (-torch.cat(policy.token_logprobs(prompts, completions)).mean()).backward()
        policy.zero_grad(set_to_none=True)

    def hf_forward():
        with torch.no_grad():
            hf_logprobs(hf, ids, prompt_len, grad=False)

    def hf_train():
        hf.train()
        with hf_gdn(hf, hf_train_gdn):
            (-hf_logprobs(hf, ids, prompt_len, grad=True).mean()).backward()
        hf.zero_grad(set_to_none=True)
        hf.eval()
    row = {}
    for name, fn in (("ours_forward", ours_forward), ("transformers_forward", hf_forward),
                     ("ours_forward_backward", ours_train), ("transformers_forward_backward", hf_train)):
        dt = timed(fn, steps)
        row[name] = {"seconds": round(dt, 4), "tokens_per_s": round(tokens / dt)}
        gc_heap.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--completions", default="256,1024,4095")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hf-train-gdn", choices=("torch", "fla"), default="torch",
                    help="transformers' chunked GDN in its forward + backward (see the module docstring)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    config = EngineConfig.from_yaml(a.config)
    if a.layers is not None:
        config = with_changes(config, model__random__num_hidden_layers=a.layers)
    policy = PolicyModel.from_config(config)
    hf = to_transformers(policy)
    hf.gradient_checkpointing_enable()
    gen = torch.Generator().manual_seed(0)
    vocab, tokens = policy.args.vocab_size, a.batch * a.seq_len
    report = {"config": a.config, "layers": a.layers, "batch": a.batch, "seq_len": a.seq_len,
              "gpu": torch.cuda.get_device_name(), "transformers_train_gdn": a.hf_train_gdn, "rows": []}
    for c in (int(x) for x in a.completions.split(",")):
        p = a.seq_len - c
        seqs = torch.randint(0, vocab, (a.batch, a.seq_len), generator=gen)
        prompts, completions = [s[:p].tolist() for s in seqs], [s[p:].tolist() for s in seqs]

        row = {"completion": c, "prompt": p, **measure(policy, hf, prompts, completions, seqs.cuda(), p, a.steps,
                                                        tokens, a.hf_train_gdn)}
        row["forward_ratio"] = round(row["ours_forward"]["seconds"] / row["transformers_forward"]["seconds"], 3)
        row["forward_backward_ratio"] = round(row["ours_forward_backward"]["seconds"]
                                              / row["transformers_forward_backward"]["seconds"], 3)
        report["rows"].append(row)
        print(f"completion {c:>5} (prompt {p:>5}): forward {row['ours_forward']['tokens_per_s']:>8} tok/s vs "
              f"{row['transformers_forward']['tokens_per_s']:>8} ({row['forward_ratio']}x the time); forward+backward "
              f"{row['ours_forward_backward']['tokens_per_s']:>8} vs {row['transformers_forward_backward']['tokens_per_s']:>8}"
              f" ({row['forward_backward_ratio']}x)", flush=True)
    report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
