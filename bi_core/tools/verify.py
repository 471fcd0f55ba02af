"""``bi-engine verify``: the batch-invariance audit a user runs on their own machine and model.

Each prompt runs alone first (the reference). Then, for every batch size, the same prompts run
as needles at random positions among filler requests of random lengths, half of the fillers
already decoding when the needles arrive (so prefill and decode rows mix), greedy and seeded
sampling. A needle's tokens and logprobs must be bitwise equal to its run alone."""

from __future__ import annotations

import random
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import attrs

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError
from bi_core.runtime.engine import LLMEngine
from bi_core.runtime.sequence import SamplingParams, Sequence

DEFAULT_BATCH_SIZES = (1, 2, 3, 7, 8, 15, 16, 17, 32, 64, 128, 256)
MODES = ("greedy", "sampled")
# what the checks below call each argument (the CLI passes its flags instead)
ARG_NAMES = {"num_prompts": "num_prompts", "batch_sizes": "batch_sizes", "max_new_tokens": "max_new_tokens",
             "modes": "modes", "mtp": "mtp_engine"}


@attrs.frozen
class Case:
    batch_size: int
    mode: str  # greedy | sampled
    num_needles: int
    mismatches: tuple[tuple[int, int, str], ...]  # (prompt index, first differing step, what differed)
    num_draft_tokens: int = 0  # speculative runs: drafts the needles verified, and how many were accepted
    num_accepted_draft_tokens: int = 0
    peak_in_flight: int = 0  # the most sequences the scheduler held at once during the batch's run


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The default sizes an engine can run: those up to ``scheduler.max_num_seqs``."""
    return tuple(b for b in DEFAULT_BATCH_SIZES if b <= max_num_seqs)


def check_plan(*, num_prompts: int, batch_sizes: Seq[int], max_new_tokens: int, modes: Seq[str],
               max_num_seqs: int, names: Mapping[str, str] = ARG_NAMES) -> None:
    """Refuse an audit that would compare nothing or less than it is asked to (a skipped batch
    size, an unknown mode run as another): each problem is a BiEngineError naming the argument."""
    if num_prompts < 1:
        raise BiEngineError(f"{names['num_prompts']}: expected a positive number of prompts, got {num_prompts}")
    if max_new_tokens < 1:
        raise BiEngineError(f"{names['max_new_tokens']}: expected a positive int, got {max_new_tokens}")
    if not batch_sizes:
        raise BiEngineError(f"{names['batch_sizes']}: no batch size given")
    if small := [b for b in batch_sizes if b < 1]:
        raise BiEngineError(f"{names['batch_sizes']}: batch sizes must be positive, got {small[0]}")
    if large := [b for b in batch_sizes if b > max_num_seqs]:
        raise BiEngineError(f"{names['batch_sizes']}: the audit cannot run batch sizes above scheduler.max_num_seqs="
                            f"{max_num_seqs} (got {', '.join(map(str, large))}); raise scheduler.max_num_seqs or drop "
                            "those sizes")
    if not modes or (unknown := [m for m in modes if m not in MODES]):
        raise BiEngineError(f"{names['modes']}: expected greedy and/or sampled, got "
                            f"{', '.join(map(repr, unknown)) if modes else 'none'}")


def check_drafts(cases: list[Case], names: Mapping[str, str] = ARG_NAMES) -> None:
    """With an MTP engine, the speculative runs must have verified and accepted drafts: else
    they compared plain decoding, and the audit says nothing about speculative decoding."""
    mtp = [c for c in cases if c.mode.endswith("+mtp")]
    if mtp and not sum(c.num_accepted_draft_tokens for c in mtp):
        drafted = sum(c.num_draft_tokens for c in mtp)
        raise BiEngineError(f"{names['mtp']}: the MTP runs accepted none of their {drafted} draft tokens, so "
                            f"speculative decoding was not checked; raise {names['max_new_tokens']}")


def _prompts(n: int, vocab: int, rng: random.Random, lo: int = 1, hi: int = 600) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _params(mode: str, index: int, max_new: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return SamplingParams(max_new_tokens=max_new, temperature=0.8, top_p=1.0, seed=1000 + index, ignore_eos=True)


def _forced_drafts(engine: LLMEngine, truth: dict[int, list[int]], owner: dict[int, int], rng: random.Random):
    """MTP drafts for needles: their AR tokens up to a random point, then wrong ones (random
    weights accept almost nothing by themselves), written over the head's drafts on the device
    (``draft_override``); fillers keep the head's own drafts."""
    def override(seq, n):
        index = owner.get(seq.request_id)
        if index is None:
            return None
        right = truth[index][len(seq.output_ids): len(seq.output_ids) + n]
        cut = rng.randint(0, len(right))
        return right[:cut] + [(t + 1) % engine.args.vocab_size for t in right[cut:]]
    return override


def _run(engine: LLMEngine, needles: list[tuple[int, list[int]]], fillers: list[list[int]], mode: str,
         max_new: int, rng: random.Random, truth: dict[int, list[int]] | None = None) -> tuple[dict[int, Sequence], int]:
    """Needles among fillers; (the needles' sequences, the most sequences in flight at once)."""
    owner: dict[int, int] = {}
    peak = 0
    if truth is not None:
        engine.strategy.draft_override = _forced_drafts(engine, truth, owner, rng)
    early, late = fillers[: len(fillers) // 2], fillers[len(fillers) // 2:]
    for p in early:
        engine.add_request(p, SamplingParams(max_new_tokens=rng.randint(1, 2 * max_new), ignore_eos=True))
    for _ in range(2 if early else 0):
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    arrivals: list[tuple[int | None, list[int]]] = [(None, p) for p in late] + list(needles)
    rng.shuffle(arrivals)
    seqs = {}
    for index, p in arrivals:
        if index is None:
            engine.add_request(p, SamplingParams(max_new_tokens=rng.randint(1, 2 * max_new), ignore_eos=True))
        else:
            seqs[index] = engine.add_request(p, _params(mode, index, max_new))
            owner[seqs[index].request_id] = index
    while engine.scheduler.has_work():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return seqs, peak


def _result(seq: Sequence) -> tuple[list[int], list[float]]:
    return seq.output_ids, seq.token_logprobs


def _diff(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> tuple[int, str] | None:
    for step, (ta, tb, la, lb) in enumerate(zip(a[0], b[0], a[1], b[1])):
        if ta != tb:
            return step, f"token {ta} vs {tb}"
        if la != lb:  # exact float equality: bitwise for finite values
            return step, f"logprob {la!r} vs {lb!r}"
    if len(a[0]) != len(b[0]):
        return min(len(a[0]), len(b[0])), "length"
    return None


def audit(engine: LLMEngine, *, num_prompts: int = 32, batch_sizes: Seq[int] | None = None,
          max_new_tokens: int = 32, modes: Seq[str] = MODES, seed: int = 0, log=print,
          mtp_engine: LLMEngine | None = None) -> list[Case]:
    """``batch_sizes``: default, those of DEFAULT_BATCH_SIZES up to ``scheduler.max_num_seqs``;
    a larger one, an unknown mode or no prompt is refused (``check_plan``), never skipped.
    ``mtp_engine``: also run every batch through speculative decoding (drafts forced from the
    AR outputs up to random points) and compare with the AR runs alone (guarantee G3)."""
    max_num_seqs = engine.config.scheduler.max_num_seqs
    if batch_sizes is None:
        batch_sizes = default_batch_sizes(max_num_seqs)
    check_plan(num_prompts=num_prompts, batch_sizes=batch_sizes, max_new_tokens=max_new_tokens, modes=modes,
               max_num_seqs=min(max_num_seqs, mtp_engine.config.scheduler.max_num_seqs) if mtp_engine else max_num_seqs)
    rng = random.Random(seed)
    vocab = engine.args.vocab_size
    longest = max(2, engine.max_model_len - 2 * max_new_tokens - 1)  # fillers may generate 2x max_new_tokens
    prompts = _prompts(num_prompts, vocab, rng, hi=min(600, longest))
    cases = []
    for mode in modes:
        alone = {}
        for i, p in enumerate(prompts):
            alone[i] = _result(_run(engine, [(i, p)], [], mode, max_new_tokens, rng)[0][i])
        cursor = 0
        for b in batch_sizes:
            k = min(b, 8, num_prompts)
            chosen = [(cursor + j) % num_prompts for j in range(k)]
            cursor += k
            fillers = _prompts(b - k, vocab, rng, hi=min(1024, longest))
            runs = [("ar", engine, None)] + ([("mtp", mtp_engine, {i: alone[i][0] for i in chosen})]
                                             if mtp_engine is not None else [])
            for strategy, eng, truth in runs:
                got, peak = _run(eng, [(i, prompts[i]) for i in chosen], fillers, mode, max_new_tokens, rng, truth)
                bad = tuple((i, *d) for i in chosen if (d := _diff(_result(got[i]), alone[i])) is not None)
                label = mode if strategy == "ar" else f"{mode}+mtp"
                case = Case(b, label, k, bad, sum(s.num_draft_tokens for s in got.values()),
                            sum(s.num_accepted_draft_tokens for s in got.values()), peak)
                cases.append(case)
                drafts = f", {case.num_accepted_draft_tokens}/{case.num_draft_tokens} drafts accepted" if truth else ""
                log(f"{label:<11} batch {b:>4}: {k} needles{drafts}, at most {peak} in flight, {len(bad)} mismatched" +
                    ("" if not bad else f" (first: prompt {bad[0][0]} at step {bad[0][1]}: {bad[0][2]})"))
    return cases


def probe(engine: LLMEngine, cases: list[Case], num_prompts: int, seed: int) -> str:
    """Name the op class behind the first mismatch: a prefill probe, then a decode probe
    (see bi_core/tools/diagnose.py)."""
    from bi_core.tools.diagnose import first_divergent_decode_op, first_divergent_op

    bad = next((c for c in cases if c.mismatches), None)
    if bad is None:
        return ""
    rng = random.Random(seed)
    longest = max(2, engine.max_model_len - 1)
    prompts = _prompts(num_prompts, engine.args.vocab_size, rng, hi=min(600, longest))
    fillers = _prompts(7, engine.args.vocab_size, rng, hi=min(300, longest))
    prompt = prompts[bad.mismatches[0][0]]
    if where := first_divergent_op(engine, prompt, fillers):
        return "prefill probe: first op whose rows change with the batch: " + where
    if where := first_divergent_decode_op(engine, prompt, fillers):
        return "decode probe: prefill rows are batch-independent; first op whose decode rows change: " + where
    return ("probes: prefill and decode rows are batch-independent here; the mismatch needs the "
            "scheduling of the audit (arrival order, chunking or graph buckets) to show")


def summary(cases: list[Case]) -> str:
    lines = [f"{'mode':<11} {'batch':>5} {'in flight':>9} {'needles':>7} {'accepted/drafts':>15} {'mismatches':>10}  first"]
    for c in cases:
        first = f"prompt {c.mismatches[0][0]}, step {c.mismatches[0][1]}: {c.mismatches[0][2]}" if c.mismatches else ""
        drafts = f"{c.num_accepted_draft_tokens}/{c.num_draft_tokens}" if c.mode.endswith("+mtp") else ""
        lines.append(f"{c.mode:<11} {c.batch_size:>5} {c.peak_in_flight:>9} {c.num_needles:>7} {drafts:>15} "
                     f"{len(c.mismatches):>10}  {first}")
    total = sum(len(c.mismatches) for c in cases)
    lines.append(f"total: {sum(c.num_needles for c in cases)} needle runs, {total} mismatched")
    return "\n".join(lines)


def negative_control_config(config: EngineConfig) -> EngineConfig:
    """The same model and scheduler on the default backend with invariance off."""
    return config.replace(backend="cuda_default" if config.model.device != "cpu" else "reference",
                          policy={"batch_invariant": False})


def count(cases: list[Case]) -> int:
    return sum(len(c.mismatches) for c in cases)


