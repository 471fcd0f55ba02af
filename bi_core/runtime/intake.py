"""Request intake: prompts tokenized and checked, request ids and seeds given, a prompt's n
samples grouped under their leader, each with a grammar state of its own for a structured
output (a new grammar compiles on ``Grammars``' threads while its request waits in the queue:
``settle``). Pure bookkeeping: nothing here touches the caches."""

from __future__ import annotations

from concurrent import futures

from bi_core.errors import PromptTooLongError, RequestError
from bi_core.ops.sampling import mix_seed, sample_seed
from bi_core.runtime.detokenize import TextStream
from bi_core.runtime.prompts import Prompt, as_ints
from bi_core.runtime.sequence import SamplingParams, Sequence, Status
from bi_core.structured.grammars import Grammars


class Intake:
    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int, seed: int,
                 eos_ids: tuple[int, ...] = (), compile_async: bool = True) -> None:
        """``compile_async``: a request's grammar compiles off the caller's thread while the
        request waits (False: in ``request``; tensor-parallel ranks, which must admit it at the
        same step)."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_model_len, self.max_num_seqs, self.seed = max_model_len, max_num_seqs, seed
        self.grammars = Grammars(tokenizer, vocab_size, eos_ids)  # compiles at the first structured request
        self.compile_async = compile_async
        self.pending: list[Sequence] = []  # requests queued while their grammar compiles
        self.next_id = 0  # the next request id (every tensor-parallel rank agrees on it)
        self.routed_experts = False  # whether the model logs its routing (model.enable_return_routed_experts)
        self.vision = None  # VisionInputs (runtime/vision_inputs.py) where the engine takes images

    def with_vision(self, ids: list[int], images, videos) -> tuple[list[int], object]:
        """The prompt with its placeholders expanded and its MultimodalPrompt (None: no images)."""
        if not images and not videos:
            if self.vision is not None and (self.vision.tokens.image in ids or self.vision.tokens.video in ids):
                raise RequestError("the prompt has image or video placeholder tokens but no images or videos")
            return ids, None
        if self.vision is None:
            raise RequestError("this engine takes no images: its checkpoint has no vision tower, or "
                               "vision.enabled is false")
        return self.vision.prepare(ids, images, videos)

    def token_ids(self, prompt: Prompt, what: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{what} is text but this checkpoint has no tokenizer; pass a list of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = as_ints(prompt, what)
        if not ids:
            raise RequestError(f"{what} is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def request(self, prompt: Prompt, params: SamplingParams, *, text: bool, weight_version: int,
                images=None, videos=None) -> Sequence:
        """A generation request's leader (its n samples in ``group``); raises for a bad one.
        ``images`` / ``videos``: what the prompt's placeholders stand for (runtime/vision_inputs.py)."""
        ids, mm = self.with_vision(self.token_ids(prompt), images, videos)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the model's limit (max_model_len) is "
                                     f"{self.max_model_len} including at least one generated token")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        if params.return_routed_experts and not self.routed_experts:
            raise RequestError("return_routed_experts needs the engine started with "
                               "model.enable_return_routed_experts: true (a MoE model)")
        if params.n > self.max_num_seqs:  # the samples of a prompt are admitted together
            raise RequestError(f"n={params.n} samples exceed scheduler.max_num_seqs={self.max_num_seqs} (the "
                               "samples of a prompt run together); lower n or raise scheduler.max_num_seqs")
        compiling = None
        if params.structured is not None:  # a grammar that does not parse fails before the request gets an id
            compiling = self.grammars.prepare(params.structured)
            if not self.compile_async or compiling.done():
                compiling.result()  # (and one that does not compile, where it is known now)
        max_total = min(len(ids) + params.max_new_tokens, self.max_model_len)
        seq = self._new(ids, params, max_total, weight_version, score_top=params.prompt_logprobs or 0)
        seq.group = [seq]
        for i in range(1, params.n):  # the other samples wait attached to the leader until it forks them
            f = self._new(ids, params, max_total, weight_version, seed=sample_seed(seq.seed, i), sample_index=i,
                          leader=seq, score_top=seq.score_top)
            seq.followers.append(f)
            seq.group.append(f)
        for member in seq.group:  # the samples share the images, and their embeddings once computed
            member.mm = mm
        if compiling is not None and compiling.done():
            self._attach(seq)
        elif compiling is not None:  # queued now, admitted once its grammar compiled (``settle``)
            seq.grammar_ready = compiling
            self.pending.append(seq)
        if (text or params.stop) and self.tokenizer is not None:
            for member in seq.group:
                member.text = TextStream(self.tokenizer, params.stop, include_stop=params.include_stop_str_in_output,
                                         **params.decode_options)
        return seq

    def _attach(self, seq: Sequence) -> None:
        """Each of the request's samples its own grammar state."""
        p = seq.params
        for member in seq.group:
            member.grammar = self.grammars.state(p.structured, p.stop_token_ids)

    def settle(self, wait: bool = False, wait_all: bool = False) -> list[Sequence]:
        """Give the queued requests whose grammar compiled meanwhile their grammar states (the
        scheduler admits them from then on); ``wait``: first wait until one has (``wait_all``:
        all). Returns the ones whose grammar failed to compile, finished with the error (their
        samples too)."""
        if not self.pending:
            return []
        if wait or wait_all:
            futures.wait([s.grammar_ready for s in self.pending],
                         return_when=futures.ALL_COMPLETED if wait_all else futures.FIRST_COMPLETED)
        failed, still = [], []
        for seq in self.pending:
            ready = seq.grammar_ready
            if seq.status is Status.FINISHED:  # aborted while it compiled
                continue
            if not ready.done():
                still.append(seq)
                continue
            seq.grammar_ready = None
            try:
                ready.result()
            except RequestError as e:
                for member in seq.group:
                    member.finish("error", str(e))
                failed.append(seq)
                continue
            self._attach(seq)
        self.pending = still
        return failed

    def score_request(self, prompt: Prompt, continuation: Prompt, *, exact: bool, logprobs: int,
                      weight_version: int, lora_name: str | None = None, images=None, videos=None) -> Sequence:
        """A scoring request: prompt + continuation, the continuation's logprobs wanted (the
        prompt's placeholders standing for ``images`` / ``videos``)."""
        ids, cont = self.token_ids(prompt), self.token_ids(continuation, "continuation")
        whole, mm = self.with_vision(ids + cont, images, videos)  # (the continuation's positions follow the prompt's)
        ids = whole[:len(whole) - len(cont)]
        if not 0 <= logprobs <= 20:
            raise RequestError(f"logprobs must be in 0..20, got {logprobs!r}")
        total = len(ids) + len(cont)
        if total > self.max_model_len:
            raise PromptTooLongError(f"prompt + continuation have {total} tokens; the model's limit (max_model_len) "
                                     f"is {self.max_model_len}")
        seq = self._new(ids + cont, SamplingParams(max_new_tokens=1, lora_name=lora_name), total, weight_version,
                        score_from=len(ids), exact=exact, score_top=logprobs)
        seq.mm = mm
        return seq

    def _new(self, ids: list[int], params: SamplingParams, max_total_len: int, weight_version: int,
             seed: int | None = None, **fields) -> Sequence:
        rid, self.next_id = self.next_id, self.next_id + 1
        if seed is None:
            seed = params.seed if params.seed is not None else mix_seed(self.seed, rid)
        return Sequence(request_id=rid, prompt_ids=ids, params=params, seed=seed, max_total_len=max_total_len,
                        weight_version=weight_version, **fields)
