"""The engine: the request API and the step loop over a scheduler, a strategy and a model runner.

One step: the scheduler picks the rows (``schedule``), the strategy plans the model call
(``plan``), the runner executes it (``execute``), the strategy says what it did (``commit``), and
the scheduler, the one writer of sequence state, applies that (``update``, then ``fork`` for
n samples and ``finish``). Parts are built in ``runtime/build.py``."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence as Seq
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError, PromptTooLongError, RequestError
from bi_core.models.loader import CheckpointIndex, TensorDict, apply_update, check_update, update_weights
from bi_core.models.qwen3_5 import check_tensor_parallel
from bi_core.models.tokenizer import tokenizer_for
from bi_core.ops.sampling import device_sampled, mix_seed, sample_seed
from bi_core.parallel import lockstep
from bi_core.parallel.shard import TPInfo
from bi_core.policies.apply import applied
from bi_core.registry import Registry
from bi_core.runtime.build import build_parts, explain, prepare, resolve_max_model_len, resolve_model
from bi_core.runtime.detokenize import TextStream
from bi_core.runtime.prompts import Prompt, as_ints, ids_or_empty, is_one_prompt
from bi_core.runtime.runner import StepOutput
from bi_core.runtime.sequence import (
    RequestOutput,
    SamplingParams,
    ScoreOutput,
    Sequence,
    Status,
    request_output,
)
from bi_core.runtime.step import StepPlan
from bi_core.runtime.warmup import warm_up

log = logging.getLogger(__name__)
__all__ = ["LLMEngine", "explain", "resolve_model"]  # explain and resolve_model: built in runtime/build.py


@attrs.define
class _Ahead:
    """A step launched before the previous one was committed, its samples on their way to the host."""

    plan: StepPlan
    out: StepOutput


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: Registry | None = None, *, tp_rank: int = 0) -> None:
        """``tp_rank``: set only by a tensor-parallel worker process (``bi_core.parallel.lockstep``);
        users build rank 0, which starts the other ranks itself."""
        self.config = config
        self.registry, self.policy, self.factory = prepare(config, registry, rank=tp_rank)
        self.device, self.dtype = self.factory.base["device"], self.factory.base["dtype"]
        self.args, index = resolve_model(config)
        self.tp = TPInfo(tp_rank, config.parallel.tensor_parallel_size)
        check_tensor_parallel(self.args, self.tp.world)
        resolve_max_model_len(config, self.args)
        self._driver = None  # rank 0 of a tensor-parallel engine, once every rank is built: the other ranks
        driver = lockstep.launch(config, self.device) if self.tp.world > 1 and tp_rank == 0 else None
        if driver is not None:
            atexit.register(driver.close)  # also when this constructor fails: the other ranks are stopped
        parts = build_parts(config, self.registry, self.policy, self.factory, self.args, index, self.tp)
        self.model, self.runner, self.scheduler, self.strategy = parts.model, parts.runner, parts.scheduler, parts.strategy
        self.cache, self.max_model_len = self.runner.cache, parts.max_model_len
        self.tokenizer = tokenizer_for(config.model)
        self.eos_ids = self.args.eos_token_ids
        self.overlap = config.graph.overlap
        self.requests: dict[int, Sequence] = {}  # unfinished requests by id
        self.weight_version = 0  # update_weights calls so far; every result says which weights made it
        self.num_steps = self.num_ahead = 0  # steps run; of them, launched before the previous one was committed
        self._next_id = 0
        self._ahead: _Ahead | None = None
        self.warmup = None
        if config.graph.warmup and config.graph.enabled and self.device.type == "cuda":
            self.warmup = warm_up(self)  # every rank runs the same warm-up, before the lock-step starts
        if driver is not None:
            driver.started = True
            self._driver = driver

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op with one rank); the engine is unusable after."""
        if self._driver is not None:
            self._driver.close()

    @property
    def on_logits(self):
        """Debugging hook: called with (sequences, logits) before each sampling (``ModelRunner.on_logits``)."""
        return self.runner.on_logits

    @on_logits.setter
    def on_logits(self, hook) -> None:
        self.runner.on_logits = hook

    @property
    def in_flight(self) -> list | None:
        """The scheduled rows of a step launched ahead and not yet committed (overlap), or None."""
        return self._ahead.plan.scheduled if self._ahead is not None else None

    @property
    def num_prompt_tokens_computed(self) -> int:
        """Prompt tokens the model ran (not cached, not shared by n samples)."""
        return self.scheduler.num_prompt_tokens_computed

    def reset_counters(self) -> None:
        """Forget the warm-up: request ids restart at 0, prompt-token and prefix-cache counts at 0."""
        self._next_id = self.scheduler.num_prompt_tokens_computed = 0
        if self.cache.prefix is not None:
            self.cache.prefix.clear(reset_stats=True)

    def lockstep_check(self) -> tuple[int, int, int]:
        """What every rank must agree on before a step: (steps run, next request id, requests)."""
        return self.num_steps, self._next_id, len(self.requests)

    def _mirror(self, message) -> None:
        """Tensor parallel, rank 0: the other ranks replay this intake before the next step."""
        if self._driver is not None:
            self._driver.record(message)

    # ------------------------------------------------------------------ requests

    def _token_ids(self, prompt: Prompt, what: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{what} is text but this checkpoint has no tokenizer; pass a list of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = as_ints(prompt, what)
        if not ids:
            raise RequestError(f"{what} is empty")
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise RequestError(f"{what} has token ids outside the vocabulary [0, {self.args.vocab_size}): {bad[:5]}")
        return ids

    def _new_seq(self, ids: list[int], params: SamplingParams, max_total_len: int, seed: int | None = None,
                 **fields) -> Sequence:
        rid, self._next_id = self._next_id, self._next_id + 1
        if seed is None:
            seed = params.seed if params.seed is not None else mix_seed(self.config.seed, rid)
        seq = Sequence(request_id=rid, prompt_ids=ids, params=params, seed=seed, max_total_len=max_total_len,
                       weight_version=self.weight_version, **fields)
        self.requests[rid] = seq
        return seq

    def add_request(self, prompt: Prompt, params: SamplingParams, *, text: bool = False) -> Sequence:
        """Queue one request; raises RequestError / PromptTooLongError for a bad one. With ``text``
        (or stop strings) its text is decoded as it grows (``seq.text``), for streaming."""
        ids = self._token_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the model's limit (max_model_len) is "
                                     f"{self.max_model_len} including at least one generated token")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        limit = self.config.scheduler.max_num_seqs
        if params.n > limit:  # the samples of a prompt are admitted together
            raise RequestError(f"n={params.n} samples exceed scheduler.max_num_seqs={limit} (the samples of a "
                               "prompt run together); lower n or raise scheduler.max_num_seqs")
        max_total = min(len(ids) + params.max_new_tokens, self.max_model_len)
        seq = self._new_seq(ids, params, max_total, score_top=params.prompt_logprobs or 0)
        seq.group = [seq]
        for i in range(1, params.n):  # the other samples wait attached to the leader until it forks them
            f = self._new_seq(ids, params, max_total, seed=sample_seed(seq.seed, i), sample_index=i, leader=seq,
                              score_top=seq.score_top)
            seq.followers.append(f)
            seq.group.append(f)
        if (text or params.stop) and self.tokenizer is not None:
            for member in seq.group:
                member.text = TextStream(self.tokenizer, params.stop)
        self.scheduler.add(seq)
        self._mirror(lockstep.AddRequest(prompt, params, text))
        return seq

    def add_score_request(self, prompt: Prompt, continuation: Prompt, *, exact: bool = True,
                          logprobs: int = 0) -> Sequence:
        """Queue one scoring request: the logprob of each continuation token after the prompt
        (see ``score``). Steps run it alongside generation requests."""
        ids, cont = self._token_ids(prompt), self._token_ids(continuation, "continuation")
        if not 0 <= logprobs <= 20:
            raise RequestError(f"logprobs must be in 0..20, got {logprobs!r}")
        total = len(ids) + len(cont)
        if total > self.max_model_len:
            raise PromptTooLongError(f"prompt + continuation have {total} tokens; the model's limit (max_model_len) "
                                     f"is {self.max_model_len}")
        seq = self._new_seq(ids + cont, SamplingParams(max_new_tokens=1), total, score_from=len(ids), exact=exact,
                            score_top=logprobs)
        self.scheduler.add(seq)
        self._mirror(lockstep.AddScoreRequest(prompt, continuation, exact, logprobs))
        return seq

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request (``finish_reason='abort'``); its KV pages and state slot are
        free for the next step. False if there is no such request. Call between steps."""
        self._mirror(lockstep.Abort(request_id))
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        for f in list(seq.followers):  # samples not yet forked cannot run without their leader
            self.abort(f.request_id)
        self.scheduler.abort(seq)
        self.strategy.forget(seq)
        seq.finish("abort")
        return True

    # ------------------------------------------------------------------ the step loop

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it."""
        if not self.scheduler.has_work():
            return []
        if self._driver is not None:
            self._driver.send_now(lockstep.Step(self.lockstep_check()))
        self.num_steps += 1
        ahead, self._ahead = self._ahead, None
        with torch.inference_mode(), applied(self.policy):
            if ahead is not None and any(r.seq.status is Status.RUNNING for r in ahead.plan.forward.rows):
                plan, out = ahead.plan, ahead.out
            else:  # nothing launched ahead, or every row's request ended (stop token, abort)
                scheduled = self.scheduler.schedule()
                if not scheduled:
                    raise BiEngineError("internal: the scheduler could not place any request (cache too small?)")
                plan = self.strategy.plan(scheduled)
                out = self.runner.execute(plan.forward)
            landing = None
            if self.overlap and self.strategy.plans_ahead and self._flies(plan, out):
                landing = self.runner.land(out.samples)
                self._ahead = self._launch_ahead(plan, out)
            commit = self.strategy.commit(plan, out, landing.wait() if landing is not None else None)
            self.scheduler.update(commit)
            self.strategy.after_update(plan, commit, out)
            forked = self.scheduler.fork(commit.forks) if commit.forks else []
            if forked:
                self.strategy.after_fork(commit.forks, plan, out)
        done = [s for s in [c.seq for c in commit.seqs] + forked if s.status is Status.FINISHED]
        for seq in done:
            self.scheduler.finish(seq)
            self.strategy.forget(seq)
            self.requests.pop(seq.request_id, None)
        return done

    def _flies(self, plan: StepPlan, out: StepOutput) -> bool:
        """Whether a step's device samples are all its commit needs, so they can be copied to the
        host behind it: a graph replay (uniform rows), every row sampled on the device, for
        requests that want nothing more (no filtering, top-N logprobs, n-sample fork or hook)."""
        rows = plan.forward.rows
        return (out.samples is not None and out.graph is not None and self.runner.on_logits is None
                and all(r.sample for r in rows)
                and not any(r.seq.followers for r in rows) and device_sampled([r.seq for r in rows]))

    def _launch_ahead(self, plan: StepPlan, out: StepOutput) -> _Ahead | None:
        """Overlapped decode (``graph.overlap``): plan, stage and launch the decode step after
        ``plan`` before its tokens reach the host, so the device never waits for the host's
        planning and bookkeeping. The next step is exactly what ``schedule`` would return after
        this one (``Scheduler.plan_decode`` refuses otherwise: requests waiting, pages short,
        ...), except that a sequence this step ends with a stop token still runs one wasted row
        in it; that row's output is dropped, and its pages and state slot, released when this
        step is committed, are reused only by work queued after it. Requests added between steps
        are admitted one step later. Every row computes what it would alone, so outputs are the
        same bits with or without overlap (tests/strategies/test_overlap.py)."""
        continuing, ending = [], []
        for r in plan.forward.rows:
            if r.seq.status is Status.RUNNING:
                (ending if r.seq.at_length(1) else continuing).append(r.seq)
        scheduled = self.scheduler.plan_decode(continuing, ending)
        if scheduled is None:
            return None
        nxt = self.strategy.plan_ahead(scheduled, plan, out)
        if nxt is None:
            return None
        self.runner.wait_inputs()  # the running step's staged inputs are on the device: host buffers are free
        self.num_ahead += 1
        return _Ahead(nxt, self.runner.execute(nxt.forward))

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights, *, abort_unfinished: bool = False) -> int:
        """Copy new weights into the model's parameters in place (CUDA graphs stay valid).

        ``weights``: a checkpoint directory, a ``{name: tensor}`` mapping (e.g. a trainer's
        ``state_dict``, or ``engine.model.state_dict()``) or ``(name, tensor)`` pairs, named as
        Hugging Face names them or as the engine's own parameters; any subset of the model's
        tensors, on any device. Dtypes: a tensor must be in the engine's dtype (``model.dtype``)
        or in float32, which is rounded to it as ``.to()`` rounds (fp32 master weights into a
        bfloat16 engine); any other dtype (bfloat16 into a float32 engine, float16) is refused.
        A checkpoint directory is read as at load (float32/bfloat16/float16, cast). Every name,
        shape and dtype is checked before anything changes: a refused update copies nothing and
        aborts nothing. Call it between steps with no request unfinished (results would mix two
        models), or ``abort_unfinished=True`` to abort them. Cached prefixes are dropped. Returns
        the number of tensors copied."""
        if self.requests and not abort_unfinished:
            raise RequestError(f"update_weights: {len(self.requests)} request(s) unfinished; their tokens would "
                               "mix two models. Finish them, or pass abort_unfinished=True")
        is_path = isinstance(weights, (str, Path))
        source = CheckpointIndex(weights) if is_path else TensorDict(weights)
        steps = check_update(self.model, source)  # raises before any request is aborted or any rank is sent to
        for rid in list(self.requests):
            self.abort(rid)
        if self._driver is not None:  # tensor parallel: the aborts go first, then every rank takes its shard
            if is_path:
                self._driver.send_now(lockstep.UpdateWeightsFromPath(str(weights)))  # each rank reads its shard
            else:
                self._driver.send_weights(source, [st.name for st in steps], self.device)
        count = apply_update(self.model, source, steps)
        self._after_update()
        return count

    def receive_weights(self, meta: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Tensor-parallel rank > 0: rank 0's ``update_weights`` tensors, received one at a time
        (rank 0 checked them all first) and copied into this rank's shard."""
        for name, shape, dtype in meta:
            update_weights(self.model, TensorDict([(name, lockstep.receive_tensor(shape, dtype, self.device))]))
        self._after_update()

    def _after_update(self) -> None:
        if self.cache.prefix is not None:
            self.cache.prefix.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.weight_version += 1

    # ------------------------------------------------------------------ batch API

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; results come back in prompt order, one per prompt. A prompt
        is a str or a sequence of token ids (Python, numpy or torch integers). ``prompts`` is a
        list of prompts (``["a", "b"]``, ``[[1, 2], [3]]``, a 2-D array), or one prompt alone: a
        str, or a flat sequence of ids (``[1, 2, 3]``, a 1-D array), which gives a list of one
        result. A request that cannot be served (too long, bad ids) gets ``finish_reason='error'``
        while the others go on."""
        prompts = [prompts] if is_one_prompt(prompts) else list(prompts)
        params = params or SamplingParams()
        per_request = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(per_request)} SamplingParams")
        seqs: list[Sequence | tuple[list[int], str]] = []
        for prompt, p in zip(prompts, per_request):
            try:
                seqs.append(self.add_request(prompt, p))
            except RequestError as e:
                seqs.append((ids_or_empty(prompt), str(e)))
        self._run_all(sum(len(s.group) for s in seqs if isinstance(s, Sequence)), "generate", progress)
        return [self.output_of(s) for s in seqs]

    def score(self, prompts: Seq[Prompt], continuations: Seq[Prompt], *, exact: bool = True, logprobs: int = 0,
              progress: bool = False) -> list[ScoreOutput]:
        """The logprob of every continuation token given the prompt and the tokens before it.

        ``exact=True``: each prompt is prefilled in the chunks generation uses and the
        continuation runs in decode arithmetic (GDN recurrent form), so on an invariant backend a
        scored logprob equals, bitwise, the one the engine reported when it sampled that token
        (from that prompt, with these weights). ``exact=False``: one chunked prefill over prompt
        and continuation, faster, equal only to float tolerance. ``logprobs``: also the top-N
        per token. A pair that cannot be scored comes back with ``error`` set. As in ``generate``,
        a lone prompt and continuation (a str, or a flat sequence of ids each) are one pair."""
        prompts = [prompts] if is_one_prompt(prompts) else list(prompts)
        continuations = [continuations] if is_one_prompt(continuations) else list(continuations)
        if len(prompts) != len(continuations):
            raise RequestError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        seqs: list[Sequence | str] = []
        for prompt, cont in zip(prompts, continuations):
            try:
                seqs.append(self.add_score_request(prompt, cont, exact=exact, logprobs=logprobs))
            except RequestError as e:
                seqs.append(str(e))
        self._run_all(sum(isinstance(s, Sequence) for s in seqs), "score", progress)
        return [ScoreOutput.of(s, exact) for s in seqs]

    def _run_all(self, total: int, desc: str, progress: bool) -> None:
        bar = tqdm(total=total, desc=desc, unit="req", disable=not progress)
        while self.scheduler.has_work():
            bar.update(len(self.step()))
        bar.close()

    def output_of(self, s: Sequence | tuple[list[int], str]) -> RequestOutput:
        """A request's result as the user sees it (also for a request still running); for a
        prompt with n > 1 samples, sample 0's with all n in ``samples``."""
        if not isinstance(s, Sequence):
            ids, error = s
            return RequestOutput(request_id=-1, prompt_token_ids=ids, token_ids=[], text=None, token_logprobs=[],
                                 logprobs=None, finish_reason="error", error=error)
        if len(s.group) > 1:
            samples = [request_output(x, self.tokenizer) for x in s.group]
            return attrs.evolve(samples[0], samples=samples)
        return request_output(s, self.tokenizer)
