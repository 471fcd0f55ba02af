"""RL rollout workloads on one engine: n samples vs independent requests, a shared prefix cached vs
cold, exact vs fast scoring, an in-place weight update, and sleep/wake. Each comparison also checks that the
two ways give bitwise the same tokens and logprobs (on an invariant backend they must).

  python3 benchmarks/rl_bench.py CONFIG [--parts grpo,prefix,score,update,sleep,loop] [--prompts 32] [--n 16]
      [--prompt-len 1024] [--new-tokens 256] [--prefix-len 4096] [--requests 256] [--chunk 1024]
      [--num-layers N] [--rounds 2] [--gpu-memory-utilization F]

``loop`` is issue 24's GRPO-shaped loop: generate (prompts x n) -> exact scoring -> weight sync
from a trainer process on the same GPU (CUDA IPC, every weight) -> generate again, per round.

Random token-id prompts. One engine for every part (a 35B-A3B engine fills most of an H200); the
"independent" and "cold" baselines run on it with the prefix cache detached."""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import attrs
import torch

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.ops.sampling import sample_seed


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def no_prefix_cache(eng):
    prefix, eng.cache.prefix = eng.cache.prefix, None
    try:
        yield
    finally:
        eng.cache.prefix = prefix


def timed(eng, fn, *args, **kwargs):
    """(``fn(*args, **kwargs)``, seconds, prompt tokens the model computed)"""
    sync()
    before, t0 = eng.num_prompt_tokens_computed, time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    return out, time.perf_counter() - t0, eng.num_prompt_tokens_computed - before


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs


def grpo(eng, args, rng) -> None:
    prompts = [[rng.randrange(eng.args.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=17, n=args.n, ignore_eos=True)
    eng.generate(prompts[:2], attrs.evolve(params, max_new_tokens=4))  # warm-up (compiles, graphs)
    with no_prefix_cache(eng):
        grouped, t_g, p_g = timed(eng, lambda: eng.generate(prompts, [attrs.evolve(params, seed=17 + i)
                                                                       for i in range(len(prompts))]))
        singles = [attrs.evolve(params, n=1, seed=sample_seed(17 + i, j)) for i in range(len(prompts))
                   for j in range(args.n)]
        alone, t_a, p_a = timed(eng, lambda: eng.generate([p for p in prompts for _ in range(args.n)], singles))
    flat = [s for g in grouped for s in g.outputs]
    equal = sum(same(a, b) for a, b in zip(flat, alone))
    toks = args.prompts * args.n * args.new_tokens
    print(f"grpo {args.prompts} prompts x n={args.n}, {args.prompt_len} -> {args.new_tokens} tokens")
    print(f"  n samples   : {t_g:7.2f} s  {toks / t_g:8.0f} out tok/s  prompt tokens computed {p_g}")
    print(f"  independent : {t_a:7.2f} s  {toks / t_a:8.0f} out tok/s  prompt tokens computed {p_a}")
    print(f"  speedup {t_a / t_g:.2f}x; prefill saved {1 - p_g / p_a:.1%}; bitwise equal samples {equal}/{len(flat)}")


def prefix(eng, args, rng) -> None:
    shared = [rng.randrange(eng.args.vocab_size) for _ in range(args.prefix_len)]
    prompts = [shared + [rng.randrange(eng.args.vocab_size) for _ in range(64)] for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=5, ignore_eos=True)
    with no_prefix_cache(eng):
        cold, t_c, p_c = timed(eng, lambda: eng.generate(prompts, params))
    eng.cache.prefix.clear()
    _, t_w, p_w = timed(eng, lambda: eng.generate(prompts[:1], params))  # the first request fills the cache
    stats0 = eng.cache.prefix.stats()
    hot, t_h, p_h = timed(eng, lambda: eng.generate(prompts[1:], params))
    stats = {k: v - stats0[k] for k, v in eng.cache.prefix.stats().items()}
    equal = sum(same(a, b) for a, b in zip(hot, cold[1:]))
    toks = (args.requests - 1) * 128
    print(f"prefix: {args.requests} requests = shared {args.prefix_len} + 64 own tokens -> 128 tokens")
    print(f"  cold        : {t_c:7.2f} s  prompt tokens computed {p_c}")
    print(f"  cached      : first request {t_w:.2f} s ({p_w} tokens), then {args.requests - 1} requests "
          f"{t_h:7.2f} s  {toks / t_h:8.0f} out tok/s  prompt tokens computed {p_h}")
    print(f"  hits {stats['hits']}/{stats['queries']}, tokens from cache {stats['hit_tokens']}; "
          f"snapshots held {eng.cache.prefix.stats()['snapshots']} x {eng.cache.state_slot_bytes / 2**20:.1f} MiB; "
          f"bitwise equal to cold {equal}/{len(hot)}")


def score(eng, args, rng) -> None:
    prompts = [[rng.randrange(eng.args.vocab_size) for _ in range(args.prompt_len)] for _ in range(64)]
    gen = eng.generate(prompts, SamplingParams(max_new_tokens=512, temperature=1.0, seed=3, ignore_eos=True))
    conts = [g.token_ids for g in gen]
    with no_prefix_cache(eng):
        exact, t_e, _ = timed(eng, lambda: eng.score(prompts, conts, exact=True))
        fast, t_f, _ = timed(eng, lambda: eng.score(prompts, conts, exact=False))
    n = sum(len(c) for c in conts)
    eq_e = sum(a == b for s, g in zip(exact, gen) for a, b in zip(s.token_logprobs, g.token_logprobs))
    eq_f = sum(a == b for s, g in zip(fast, gen) for a, b in zip(s.token_logprobs, g.token_logprobs))
    err = max(abs(a - b) for s, g in zip(fast, gen) for a, b in zip(s.token_logprobs, g.token_logprobs))
    print(f"score: 64 x ({args.prompt_len} prompt + 512 continuation)")
    print(f"  exact       : {t_e:7.2f} s  {64 * (args.prompt_len + 512) / t_e:8.0f} tok/s  equal to sampled {eq_e}/{n}")
    print(f"  fast        : {t_f:7.2f} s  {64 * (args.prompt_len + 512) / t_f:8.0f} tok/s  equal to sampled {eq_f}/{n} "
          f"(max abs diff {err:.3g})")


def weight_specs(eng) -> list[tuple[str, tuple, tuple]]:
    """``(Hugging Face name, source key, shape)`` of every tensor of the model (experts fused, as
    transformers' state_dict has them); the layers of one type share a source key."""
    from bi_core.models.weight_map import weight_map

    wmap = weight_map(eng.args, with_mtp=eng.model.mtp is not None)
    return [(name, (name.split(".layers.")[-1].split(".", 1)[-1], tuple(place.shape)), tuple(place.shape))
            for name, place in wmap.by_name.items()
            if not (".experts." in name and name.split(".experts.")[1][0].isdigit())]  # per-expert spellings


def random_weights(specs, dtype: torch.dtype, device, generator: torch.Generator | None = None
                   ) -> dict[str, torch.Tensor]:
    """Random tensors for ``specs``, one source per key, so the source costs little memory."""
    by_key: dict[tuple, torch.Tensor] = {}
    for _, key, shape in specs:
        if key not in by_key:
            by_key[key] = (torch.randn(shape, device=device, generator=generator) * 0.02).to(dtype)
    return {name: by_key[key] for name, key, _ in specs}


def random_hf_weights(eng) -> dict[str, torch.Tensor]:
    """Every tensor of the model in Hugging Face names, random (``weight_specs``, ``random_weights``)."""
    return random_weights(weight_specs(eng), eng.dtype, eng.device)


def update(eng, args, rng) -> None:
    weights = random_hf_weights(eng)
    numel = sum(t.numel() for t in weights.values())
    count, t, _ = timed(eng, lambda: eng.update_weights(weights))
    print(f"update_weights: {count} tensors, {numel * 2 / 2**30:.1f} GiB from GPU tensors in {t:.2f} s "
          f"({numel * 2 / t / 2**30:.0f} GiB/s)")


def free_gib() -> float:
    sync()
    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else 0.0


def sleep(eng, args, rng) -> None:
    """Sleep level 1 (weights to host memory) and level 2 (weights dropped, refilled by a weight
    update): device memory released, the time of each call, and the outputs after waking bitwise
    equal to those before (level 2: to those of an engine updated with the same weights awake).
    Each figure is printed as soon as it is measured."""
    prompts = [[rng.randrange(eng.args.vocab_size) for _ in range(256)] for _ in range(16)]
    params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=11, ignore_eos=True)
    before, t_warm, _ = timed(eng, lambda: eng.generate(prompts, params))
    print(f"sleep: 16 x 256 -> 32 tokens awake {t_warm:.2f} s")
    awake = free_gib()
    _, t_s, _ = timed(eng, lambda: eng.sleep(1))
    asleep = free_gib()
    print(f"sleep level 1: {asleep - awake:.1f} GiB released ({awake:.1f} -> {asleep:.1f} GiB free) in {t_s:.2f} s")
    _, t_w, _ = timed(eng, lambda: eng.wake_up())
    print(f"  wake_up {t_w:.2f} s (weights copied back, every CUDA graph captured again)")
    after, t_g, _ = timed(eng, lambda: eng.generate(prompts, params))
    equal = sum(same(a, b) for a, b in zip(after, before))
    print(f"  generate after waking {t_g:.2f} s; bitwise equal to before {equal}/{len(before)}")
    _, t_s2, _ = timed(eng, lambda: eng.sleep(1))  # the host buffer is page-locked already: copies only
    _, t_w2, _ = timed(eng, lambda: eng.wake_up())
    again = eng.generate(prompts, params)
    equal = sum(same(a, b) for a, b in zip(again, before))
    print(f"  second level-1 sleep {t_s2:.2f} s (host buffer kept), wake_up {t_w2:.2f} s; bitwise equal {equal}/{len(before)}")
    weights = random_hf_weights(eng)
    eng.update_weights(weights)
    ref = eng.generate(prompts, params)
    awake = free_gib()
    _, t_s, _ = timed(eng, lambda: eng.sleep(2))
    asleep = free_gib()
    print(f"sleep level 2: {asleep - awake:.1f} GiB released in {t_s:.2f} s")
    _, t_w, _ = timed(eng, lambda: eng.wake_up(["weights"]))
    _, t_u, _ = timed(eng, lambda: eng.update_weights(weights))
    _, t_k, _ = timed(eng, lambda: eng.wake_up(["kv_cache"]))
    after, t_g, _ = timed(eng, lambda: eng.generate(prompts, params))
    equal = sum(same(a, b) for a, b in zip(after, ref))
    print(f"  wake_up(weights) {t_w:.2f} s, update_weights {t_u:.2f} s, wake_up(kv_cache) {t_k:.2f} s, "
          f"generate {t_g:.2f} s; bitwise equal to the same update awake {equal}/{len(ref)}")


def _trainer(specs: list[tuple[str, tuple, tuple]], dtype: torch.dtype, device: str, conn) -> None:
    """A trainer process on the engine's GPU: per round, new random weights (one source tensor per
    layer-type key, as ``random_hf_weights``), shared by CUDA IPC handle; held until the engine is
    done with them."""
    from bi_core.rl import serialize_named_tensors

    while (seed := conn.recv()) is not None:
        weights = random_weights(specs, dtype, device, torch.Generator(device=device).manual_seed(seed))
        sync()
        conn.send(serialize_named_tensors(weights.items()))
        conn.recv()  # the engine has copied them
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()


def loop(eng, args, rng) -> None:
    """GRPO-shaped rounds: generate (prompts x n, sampled) -> exact scoring of every sample (must
    equal the sampled logprobs bitwise) -> audit (samples re-run alone, one at a time, must equal
    the batch's bitwise) -> weight sync from a trainer process by CUDA IPC (every weight of the
    model) -> the next round on the new weights."""
    import multiprocessing as mp

    specs = weight_specs(eng)
    numel = sum(torch.Size(shape).numel() for *_, shape in specs)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(target=_trainer, args=(specs, eng.dtype, eng.device.type, theirs),
                          daemon=True)
    trainer.start()
    prompts = [[rng.randrange(eng.args.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, n=2))  # warm-up
    print(f"loop: {args.rounds} rounds of {args.prompts} prompts x n={args.n}, {args.prompt_len} -> "
          f"{args.new_tokens} tokens; weight sync of {len(specs)} tensors ({numel * 2 / 2**30:.1f} GiB) by handle (CUDA IPC on a GPU) "
          f"from a trainer process")
    bad = 0
    try:
        for r in range(args.rounds):
            params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1000 * r + i, n=args.n,
                                     ignore_eos=True) for i in range(len(prompts))]
            groups, t_gen, _ = timed(eng, eng.generate, prompts, params)
            flat = [(i, s) for i, g in enumerate(groups) for s in g.outputs]
            scores, t_score, _ = timed(eng, eng.score, [prompts[i] for i, _ in flat],
                                         [s.token_ids for _, s in flat], exact=True)
            n_tok = sum(len(s.token_ids) for _, s in flat)
            eq_score = sum(a == b for (_, s), sc in zip(flat, scores) for a, b in zip(s.token_logprobs, sc.token_logprobs))
            picks = flat[:: max(1, len(flat) // 8)][:8]  # 8 samples across the batch, each re-run alone
            t0 = time.perf_counter()
            alone = [eng.generate([prompts[i]], attrs.evolve(params[i], n=1, seed=sample_seed(params[i].seed,
                                                                                               s.sample_index)))[0]
                     for i, s in picks]
            t_audit = time.perf_counter() - t0
            eq_audit = sum(same(a, s) for a, (_, s) in zip(alone, picks))
            versions = {s.weight_version for _, s in flat}
            print(f"  round {r} (weight version {sorted(versions)}): generate {t_gen:6.2f} s "
                  f"({n_tok / t_gen:7.0f} out tok/s); exact scoring {t_score:6.2f} s, equal to sampled {eq_score}/{n_tok}; "
                  f"audit: {eq_audit}/{len(picks)} samples alone == in the batch ({t_audit:.1f} s)")
            bad += (n_tok - eq_score) + (len(picks) - eq_audit)
            if r == args.rounds - 1:
                break
            t0 = time.perf_counter()
            ours.send(1 + r)
            payload = ours.recv()
            t_make = time.perf_counter() - t0
            count, t_sync, _ = timed(eng, eng.update_weights_from_tensor, [payload], weight_version=r + 1)
            ours.send("done")
            print(f"  sync {r} -> {r + 1}: trainer made the weights in {t_make:.2f} s; update_weights_from_tensor "
                  f"{count} tensors, {numel * 2 / 2**30:.1f} GiB in {t_sync:.2f} s ({numel * 2 / t_sync / 2**30:.0f} GiB/s)")
    finally:
        ours.send(None)
        trainer.join(20)  # a CPU trial's trainer (file_system shared memory) lingers about a minute at exit
        if trainer.is_alive():
            trainer.kill()
    print(f"loop: {'PASS' if bad == 0 else 'FAIL'}: {bad} mismatches (exact scores vs sampled, alone vs batch)")
    if bad:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--parts", default="grpo,prefix,score,update")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024, help="scheduler.prefill_chunk_size (the prefix-cache grid)")
    ap.add_argument("--num-layers", type=int, help="cut a random preset to this many layers")
    ap.add_argument("--rounds", type=int, default=2, help="loop: generate/score/sync rounds")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="cache.gpu_memory_utilization (loop: leave room for the trainer's tensors)")
    args = ap.parse_args()
    cfg = EngineConfig.from_yaml(args.config)
    if args.num_layers:
        cfg = cfg.replace(model={"random": attrs.evolve(cfg.model.random, num_hidden_layers=args.num_layers)})
    cfg = cfg.replace(scheduler={"prefill_chunk_size": args.chunk},
                      model={"max_model_len": max(cfg.model.max_model_len or 0, args.prefix_len + 256, 2048)},
                      cache={"prefix_caching": True})
    if args.gpu_memory_utilization:
        cfg = cfg.replace(cache={"gpu_memory_utilization": args.gpu_memory_utilization})
    t0 = time.perf_counter()
    eng = build_engine(cfg)
    print(f"{eng.policy.backend} {cfg.model.random.preset if cfg.model.random else cfg.model.path}: built in "
          f"{time.perf_counter() - t0:.0f} s; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    rng = random.Random(0)
    for part in args.parts.split(","):
        globals()[part](eng, args, rng)


if __name__ == "__main__":
    main()
