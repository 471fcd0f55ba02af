"""The engine: the request API and the step loop over a scheduler, a strategy and a model runner.

One step: the scheduler picks the rows (``schedule``), the strategy plans the model call
(``plan``), the runner executes it (``execute``), the strategy says what it did (``commit``), and
the scheduler, the one writer of sequence state, applies that (``update``, then ``fork`` for
n samples and ``finish``). Parts are built in ``runtime/build.py``."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

import attrs
import torch
from tqdm import tqdm

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError, RequestError
from bi_core.lora.engine_calls import LoraAPI
from bi_core.models.qwen3_5 import check_tensor_parallel
from bi_core.models.tokenizer import tokenizer_for
from bi_core.parallel import lockstep
from bi_core.parallel.shard import TPInfo
from bi_core.policies.apply import applied
from bi_core.registry import Registry
from bi_core.rl.api import RolloutAPI
from bi_core.rl.collective_rpc import worker_class
from bi_core.rl.receiver import WeightSync
from bi_core.rl.rollout_control import RolloutControl
from bi_core.runtime import compile_ahead
from bi_core.runtime.build import build_parts, check_lora, prepare, resolve_max_model_len, resolve_model
from bi_core.runtime.intake import Intake
from bi_core.runtime.overlap import Overlap
from bi_core.runtime.prompts import Prompt, ids_or_empty, is_one_prompt
from bi_core.runtime.sequence import (
    RequestOutput,
    SamplingParams,
    ScoreOutput,
    Sequence,
    Status,
    request_output,
)
from bi_core.runtime.threads import size_gpu_engine_threads
from bi_core.runtime.vision_encode import VisionEncoder
from bi_core.runtime.vision_inputs import build_vision, conversation, per_prompt
from bi_core.runtime.warmup import wants_warmup, warm_up

log = logging.getLogger(__name__)


class LLMEngine(RolloutAPI, LoraAPI):
    """Requests and the step loop here; weight updates, weight sync from a trainer and pause/resume in
    ``bi_core.rl.api.RolloutAPI``."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None, *, tp_rank: int = 0,
                 start_ranks: Callable[[EngineConfig, torch.device], lockstep.Driver] | None = None) -> None:
        """``tp_rank``: set only in a tensor-parallel rank's process (``bi_core.runtime.launch``).
        ``start_ranks(config, device)``: how rank 0 of a tensor-parallel engine starts the other
        ranks (the composition root passes it: build engines with ``bi_core.build_engine``)."""
        self.config = config
        self.registry, self.policy, self.factory = prepare(config, registry, rank=tp_rank)
        self.device, self.dtype = self.factory.base["device"], self.factory.base["dtype"]
        self.args, index = resolve_model(config)
        self.tp = TPInfo(tp_rank, config.parallel.tensor_parallel_size)
        check_tensor_parallel(self.args, self.tp.world)
        check_lora(config, self.tp.world)  # before the other ranks start
        resolve_max_model_len(config, self.args)
        worker_cls = worker_class(config.parallel.worker_extension_cls)  # a bad path fails before ranks start
        self._driver = None  # rank 0 of a tensor-parallel engine, once every rank is built: the other ranks
        driver = None
        if self.tp.world > 1 and tp_rank == 0:
            if start_ranks is None:
                raise BiEngineError(f"parallel.tensor_parallel_size is {self.tp.world}: the other ranks are started by "
                                    "bi_core.build_engine (LLMEngine(config) builds one rank); build it with that")
            driver = start_ranks(config, self.device)
        if driver is not None:
            atexit.register(driver.close)  # also when this constructor fails: the other ranks are stopped
        # Triton compiles from a recorded manifest, in a thread pool while the weights are built
        self.compile_ahead = compile_ahead.start(config, self.registry, self.policy, self.args, self.device)
        # the vision tower first: its weights are on the device before the KV cache is sized by what is left
        vision, vision_inputs = build_vision(config, self.factory, self.tp.world, self.args)
        parts = build_parts(config, self.registry, self.policy, self.factory, self.args, index, self.tp)
        self.model, self.runner, self.scheduler, self.strategy = parts.model, parts.runner, parts.scheduler, parts.strategy
        self.cache, self.max_model_len = self.runner.cache, parts.max_model_len
        self.tokenizer = tokenizer_for(config.model)
        self.intake = Intake(tokenizer=self.tokenizer, vocab_size=self.args.vocab_size,
                             max_model_len=self.max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
                             seed=config.seed, eos_ids=self.args.eos_token_ids, compile_async=self.tp.world == 1)
        self.intake.routed_experts = self.runner.routing is not None
        self.runner.vision, self.intake.vision = vision, vision_inputs
        self.encoder = VisionEncoder(vision, self.device, config.vision.max_num_encoder_input_tokens)
        self.requests: dict[int, Sequence] = {}  # unfinished requests by id
        self.weight_version = 0  # update_weights calls so far; every result says which weights made it
        self._start_lora()  # lora.adapters loaded into their slots
        self.rollout, self.weight_sync = RolloutControl(self), WeightSync(self)  # bi_core/rl: pause, sync from a trainer
        self.worker = worker_cls(self)  # what collective_rpc calls methods of (bi_core/rl/collective_rpc.py)
        self.num_steps = 0
        self.overlap = Overlap(self.scheduler, self.strategy, self.runner, enabled=config.graph.overlap)
        self.warmup = None
        if wants_warmup(self):
            self.warmup = warm_up(self)  # every rank runs the same warm-up, before the lock-step starts
        else:  # (the warm-up joins it first)
            self.compile_ahead.join()  # the kernels compiled ahead are installed before any request
        if self.device.type == "cuda":
            size_gpu_engine_threads()  # after the load and warm-up (their CPU work keeps torch's default)
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
        return self.overlap.in_flight

    @property
    def num_ahead(self) -> int:
        """Steps launched before the previous one was committed (overlap)."""
        return self.overlap.num_ahead

    @property
    def num_prompt_tokens_computed(self) -> int:
        """Prompt tokens the model ran (not cached, not shared by n samples)."""
        return self.scheduler.num_prompt_tokens_computed

    def reset_counters(self) -> None:
        """Forget the warm-up: request ids restart at 0, prompt-token and prefix-cache counts at 0."""
        self.intake.next_id = self.scheduler.num_prompt_tokens_computed = 0
        if self.cache.prefix is not None:
            self.cache.prefix.clear(reset_stats=True)

    def lockstep_check(self) -> tuple[int, int, int]:
        """What every rank must agree on before a step: (steps run, next request id, requests)."""
        return self.num_steps, self.intake.next_id, len(self.requests)

    def _mirror(self, message, now: bool = False) -> None:
        """Tensor parallel, rank 0: the other ranks replay this before the next step (``now``: at once)."""
        if self._driver is not None:
            self._driver.send_now(message) if now else self._driver.record(message)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Prompt, params: SamplingParams, *, text: bool = False, images=None,
                    videos=None) -> Sequence:
        """Queue one request; raises RequestError / PromptTooLongError for a bad one. With ``text``
        (or stop strings) its text is decoded as it grows (``seq.text``), for streaming. ``images``
        / ``videos``: what the prompt's placeholder tokens stand for (docs/vision.md)."""
        self.weight_sync.check_serving()
        seq = self.intake.request(prompt, params, text=text, weight_version=self.weight_version, images=images,
                                  videos=videos)
        self._pin_lora(seq)
        self.requests.update((s.request_id, s) for s in seq.group)
        self.scheduler.add(seq)
        self._mirror(lockstep.AddRequest(prompt, params, text))
        return seq

    def add_score_request(self, prompt: Prompt, continuation: Prompt, *, exact: bool = True,
                          logprobs: int = 0, lora_name: str | None = None, images=None,
                          videos=None) -> Sequence:
        """Queue one scoring request: the logprob of each continuation token after the prompt
        (see ``score``). Steps run it alongside generation requests."""
        self.weight_sync.check_serving()
        seq = self.intake.score_request(prompt, continuation, exact=exact, logprobs=logprobs,
                                        weight_version=self.weight_version, lora_name=lora_name, images=images,
                                        videos=videos)
        self._pin_lora(seq)
        self.requests[seq.request_id] = seq
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

    def has_work(self) -> bool:
        """Whether ``step()`` would run anything: unfinished requests, neither paused nor asleep, and
        whole weights (after a level-2 sleep, queued requests wait for a weight sync)."""
        return (not self.rollout.paused and not self.runner.sleeping and self.weight_sync.coverage.whole
                and self.scheduler.has_work())

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it (none while paused or asleep)."""
        return self._step() if self.has_work() else []

    def _step(self) -> list[Sequence]:
        if self._driver is not None:
            self._driver.send_now(lockstep.Step(self.lockstep_check()))
        self.num_steps += 1
        with torch.inference_mode(), applied(self.policy):
            failed = self._settle_grammars()
            self.encoder.step(self.scheduler)  # queued requests' images, a budget a step
            ahead = self.overlap.take()
            if ahead is not None:
                plan, out = ahead
            else:
                scheduled = self.scheduler.schedule()
                while not scheduled and self.encoder.step(self.scheduler):  # nothing runs: nothing waits for them
                    scheduled = self.scheduler.schedule()
                while not scheduled and self.intake.pending:  # only requests whose grammar compiles: wait for one
                    failed += self._settle_grammars(wait=True)
                    scheduled = self.scheduler.schedule()
                if not scheduled and failed:
                    return failed
                if not scheduled:
                    raise BiEngineError("internal: the scheduler could not place any request (cache too small?)")
                plan = self.strategy.plan(scheduled)
                out = self.runner.execute(plan.forward)
            if self.strategy.masks_device_samples:  # grammar masks filled while the device runs the step
                out = self.runner.mask_samples(plan.forward, out)
            landed = self.overlap.launch_next(plan, out)  # the next step, when it can be planned now
            commit = self.strategy.commit(plan, out, landed.wait() if landed is not None else None)
            self.scheduler.update(commit)
            self.strategy.after_update(plan, commit, out)
            forked = self.scheduler.fork(commit.forks) if commit.forks else []
            if forked:
                self.strategy.after_fork(commit.forks, plan, out)
        done = [s for s in [c.seq for c in commit.seqs] + forked if s.status is Status.FINISHED] + failed
        for seq in done:
            self.scheduler.finish(seq)
            self.strategy.forget(seq)
            self.requests.pop(seq.request_id, None)
        if done and self.lora.retired:
            self.lora.collect(self._lora_in_use())  # old adapter versions whose last request finished
        return done

    def _settle_grammars(self, wait: bool = False, wait_all: bool = False) -> list[Sequence]:
        """Queued requests whose grammar compiled may be admitted now; those whose grammar failed
        to compile leave the queue, finished with the error (returned, their samples too)."""
        done = []
        for seq in self.intake.settle(wait, wait_all):
            self.scheduler.abort(seq)
            done += seq.group
        for seq in done:
            self.requests.pop(seq.request_id, None)
        return done

    # ------------------------------------------------------------------ batch API

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, progress: bool = False, images=None, videos=None) -> list[RequestOutput]:
        """Run prompts to completion; results come back in prompt order, one per prompt. A prompt
        is a str or a sequence of token ids (Python, numpy or torch integers). ``prompts`` is a
        list of prompts (``["a", "b"]``, ``[[1, 2], [3]]``, a 2-D array), or one prompt alone: a
        str, or a flat sequence of ids (``[1, 2, 3]``, a 1-D array), which gives a list of one
        result. A request that cannot be served (too long, bad ids) gets ``finish_reason='error'``
        while the others go on. ``images`` / ``videos``: each prompt's list of them (for one prompt
        alone: its list), what its placeholder tokens stand for (docs/vision.md)."""
        self.rollout.refuse_if_idle("generate")
        one = is_one_prompt(prompts)
        prompts = [prompts] if one else list(prompts)
        params = params or SamplingParams()
        per_request = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(per_request)} SamplingParams")
        media = [per_prompt(m, one, len(prompts), name) for m, name in ((images, "images"), (videos, "videos"))]
        seqs: list[Sequence | tuple[list[int], str]] = []
        for i, (prompt, p) in enumerate(zip(prompts, per_request)):
            try:
                seqs.append(self.add_request(prompt, p, images=media[0][i], videos=media[1][i]))
            except RequestError as e:
                seqs.append((ids_or_empty(prompt), str(e)))
        # a batch starts once its grammars compiled (on the compile threads, together): the same
        # steps whatever their compile times (a request added alone waits without holding up steps)
        self._settle_grammars(wait_all=True)
        self._run_all(sum(len(s.group) for s in seqs if isinstance(s, Sequence)), "generate", progress)
        return [self.output_of(s) for s in seqs]

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], params: SamplingParams | None = None, *,
             progress: bool = False) -> list[RequestOutput]:
        """Conversations through the checkpoint's chat template, one result each: ``messages`` is
        one conversation (a list of ``{"role", "content"}``) or a list of them; a content may be a
        list of text, image and video parts (``vision_inputs.conversation``; docs/vision.md). The
        template's turn end stops a request (unless ``ignore_eos``)."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer; this checkpoint has none")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = params or SamplingParams()
        prompts, images, videos, per = [], [], [], []
        for conv in convs:
            template, imgs, vids = conversation(conv)
            rendered = self.tokenizer.chat(template)
            ids, ends = rendered.ids, rendered.stop_token_ids
            prompts.append(ids)
            images.append(imgs or None)
            videos.append(vids or None)
            per.append(params if params.ignore_eos else
                       attrs.evolve(params, stop_token_ids=tuple(params.stop_token_ids) + tuple(ends)))
        return self.generate(prompts, per, progress=progress, images=images, videos=videos)

    def score(self, prompts: Seq[Prompt], continuations: Seq[Prompt], *, exact: bool = True, logprobs: int = 0,
              progress: bool = False, lora_name: str | None = None, images=None,
              videos=None) -> list[ScoreOutput]:
        """The logprob of every continuation token given the prompt and the tokens before it.

        ``exact=True``: each prompt is prefilled in the chunks generation uses and the
        continuation runs in decode arithmetic (GDN recurrent form), so on an invariant backend a
        scored logprob equals, bitwise, the one the engine reported when it sampled that token
        (from that prompt, with these weights). ``exact=False``: one chunked prefill over prompt
        and continuation, faster, equal only to float tolerance. ``logprobs``: also the top-N
        per token; ``lora_name``: under that LoRA adapter. A pair that cannot be scored comes back with
        ``error`` set. As in ``generate``,
        a lone prompt and continuation (a str, or a flat sequence of ids each) are one pair."""
        self.rollout.refuse_if_idle("score")
        one = is_one_prompt(prompts)
        prompts = [prompts] if one else list(prompts)
        continuations = [continuations] if is_one_prompt(continuations) else list(continuations)
        if len(prompts) != len(continuations):
            raise RequestError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        media = [per_prompt(m, one, len(prompts), name) for m, name in ((images, "images"), (videos, "videos"))]
        seqs: list[Sequence | str] = []
        for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
            try:
                seqs.append(self.add_score_request(prompt, cont, exact=exact, logprobs=logprobs, lora_name=lora_name,
                                                   images=media[0][i], videos=media[1][i]))
            except RequestError as e:
                seqs.append(str(e))
        self._run_all(sum(isinstance(s, Sequence) for s in seqs), "score", progress)
        return [ScoreOutput.of(s, exact) for s in seqs]

    def _run_all(self, total: int, desc: str, progress: bool) -> None:
        bar = tqdm(total=total, desc=desc, unit="req", disable=not progress)
        while self.has_work():
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
