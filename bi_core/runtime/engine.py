"""The engine: builds model, caches, scheduler and strategy from an EngineConfig and runs steps."""

from __future__ import annotations

import atexit
import logging
import operator
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError, ConfigError, PromptTooLongError, RequestError
from bi_core.models.args import ModelArgs
from bi_core.models.loader import (
    CheckpointIndex,
    TensorDict,
    apply_update,
    check_update,
    load_weights,
    read_config,
    update_weights,
)
from bi_core.models.presets import preset_args
from bi_core.models.qwen3_5 import Qwen35Model, check_tensor_parallel, local_args
from bi_core.models.random_init import init_random_weights
from bi_core.models.tokenizer import tokenizer_for
from bi_core.ops.graph_runner import GraphRunnerSpec
from bi_core.ops.sampling import SamplingBatch, device_sampled, mix_seed, sample_seed
from bi_core.parallel.lockstep import launch, rank_device
from bi_core.parallel.shard import TPInfo
from bi_core.plugins import load_registry
from bi_core.policies import check_config, make_policy, planned_device, resolve_device
from bi_core.policies.apply import applied, check_environment
from bi_core.registry import Registry
from bi_core.runtime.batch import plan_batch
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.detokenize import TextStream
from bi_core.runtime.prefix_cache import PrefixCache
from bi_core.runtime.scheduler import Scheduled, Scheduler, resolve_chunk_size
from bi_core.runtime.sequence import RequestOutput, SamplingParams, Sequence, Status
from bi_core.runtime.warmup import warm_up
from bi_core.selector import OpFactory

log = logging.getLogger(__name__)
Prompt = str | Seq[int]
SCORE_BLOCK = 256  # logits rows computed at once when scoring


def resolve_model(config: EngineConfig) -> tuple[ModelArgs, CheckpointIndex | None]:
    if config.model.random is not None:
        r = config.model.random
        return preset_args(r.preset, r.num_hidden_layers), None
    return ModelArgs.from_hf_config(read_config(config.model.path)), CheckpointIndex(config.model.path)


def prepare(config: EngineConfig, registry: Registry | None, *, live: bool = True, plan_only: bool = False,
            rank: int = 0):
    """The steps every entry point shares: registry, policy, device, config checks, op factory.
    ``live=False`` (explain on a machine without the configured GPU): the device is taken as
    configured and the checks that need it present are skipped. ``rank``: the tensor-parallel
    rank, whose device is the configured one plus ``rank``."""
    registry = registry or load_registry()
    policy = make_policy(batch_invariant=config.policy.batch_invariant, backend=config.backend,
                         op_overrides=config.policy.ops)
    device = resolve_device(config.model.device) if live else planned_device(config.model.device)
    device = rank_device(device, rank)
    check_config(config, policy, registry, device, live=live)
    if live:
        check_environment(policy, device)
    return registry, policy, OpFactory(registry, policy, device, getattr(torch, config.model.dtype), plan_only)


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: Registry | None = None, *, tp_rank: int = 0) -> None:
        """``tp_rank``: set only by a tensor-parallel worker process (``bi_core.parallel.lockstep``);
        users build rank 0, which starts the other ranks itself."""
        self.config = config
        self.registry, self.policy, self.factory = prepare(config, registry, rank=tp_rank)
        self.device, self.dtype = self.factory.base["device"], self.factory.base["dtype"]
        args, index = resolve_model(config)
        self.args = args
        self.tp = TPInfo(tp_rank, config.parallel.tensor_parallel_size)
        check_tensor_parallel(args, self.tp.world)
        self.max_model_len = config.model.max_model_len or args.max_position_embeddings
        if self.max_model_len > args.max_position_embeddings:
            raise ConfigError("model.max_model_len", f"{self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {args.max_position_embeddings}")
        self._driver = None  # rank 0 of a tensor-parallel engine, once every rank is built: the other ranks
        driver = launch(config, self.device) if self.tp.world > 1 and tp_rank == 0 else None
        if driver is not None:
            atexit.register(driver.close)  # also when this constructor fails: the other ranks are stopped
        self.checkpoint_has_mtp = index is not None and index.has_prefix("mtp.")
        with_mtp = self.checkpoint_has_mtp if index is not None else args.mtp_num_hidden_layers > 0
        try:
            self.model = Qwen35Model(args, self.factory, self.dtype, self.device, with_mtp=with_mtp, tp=self.tp)
        except torch.OutOfMemoryError:
            raise BiEngineError(f"the model's weights do not fit on {self.device} "
                                f"({_param_gib(args, self.dtype):.1f} GiB in {config.model.dtype}); use a larger GPU "
                                "or fewer layers (model.random.num_hidden_layers) for a quick run") from None
        if index is not None:
            load_weights(self.model, index)
        else:
            init_random_weights(self.model, config.model.random.seed)
        self.model.eval()
        strategy_cls = self.registry.strategies[config.strategy.name]
        lookahead = strategy_cls.lookahead_for(config)
        chunk_size = resolve_chunk_size(config.scheduler, strategy_cls.decode_tokens_for(config), config.cache.block_size)
        prefix_caching = _prefix_caching(config, strategy_cls, chunk_size)
        self.cache = CacheManager(local_args(args, self.tp.world), config.cache, num_slots=config.scheduler.max_num_seqs,
                                  max_model_len=self.max_model_len + lookahead, dtype=self.dtype,
                                  device=self.device, with_mtp=with_mtp, state_ring=strategy_cls.state_ring_for(config),
                                  num_snapshots=config.cache.prefix_snapshots if prefix_caching else 0)
        if prefix_caching:
            self.cache.prefix = PrefixCache(self.cache, grid=chunk_size,
                                            snapshot_slots=self.cache.snapshot_slots)
        capacity = self.cache.num_blocks * self.cache.block_size
        if capacity < self.max_model_len + lookahead:
            raise ConfigError("cache.num_blocks", f"the KV cache holds {capacity} tokens, fewer than one sequence "
                              f"of model.max_model_len={self.max_model_len}; raise cache.num_blocks or lower "
                              "model.max_model_len")
        max_batch = config.graph.max_batch_size or config.scheduler.max_num_seqs
        self.runner_spec = GraphRunnerSpec(
            **self.factory.base, use_graphs=config.graph.enabled, max_batch_size=max_batch,
            max_blocks_per_seq=self.cache.blocks_for(self.max_model_len + lookahead),
            scratch_page=self.cache.scratch_page, scratch_slot=self.cache.scratch_slot,
            state_ring=self.cache.state_ring, query_lens=strategy_cls.graph_query_lens(config))
        self.runner = self.factory.build("graph_runner", self.runner_spec)
        limits = [m.attn.decode_query_len for m in self.model.modules()
                  if getattr(getattr(m, "attn", None), "decode_query_len", None)]
        self.scheduler = Scheduler(config.scheduler, self.cache, chunk_size=chunk_size,
                                   exact_rebuild=self.policy.exact_preemption,
                                   lookahead=lookahead, decode_tokens=strategy_cls.decode_tokens_for(config),
                                   exact_step_tokens=min(limits, default=None))
        strategy_cls.check(self)
        self.strategy = strategy_cls(self)
        self.tokenizer = tokenizer_for(config.model)
        self.eos_ids = args.eos_token_ids
        self.on_logits = None  # debugging hook: called with (sequences, logits) before sampling
        self.requests: dict[int, Sequence] = {}  # unfinished requests by id
        self.weight_version = 0  # update_weights calls so far; every result says which weights made it
        self._next_id = 0
        self._forked: list[Sequence] = []  # samples forked in the current step
        self.num_prompt_tokens_computed = 0  # prompt tokens the model ran (not cached, not shared by n samples)
        self.num_steps = 0
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

    def lockstep_check(self) -> tuple[int, int, int]:
        """What every rank must agree on before a step: (steps run, next request id, requests)."""
        return self.num_steps, self._next_id, len(self.requests)

    def _mirror(self, name: str, *args, **kwargs) -> None:
        """Tensor parallel, rank 0: the other ranks replay this call before the next step."""
        if self._driver is not None:
            self._driver.record(name, args, kwargs)

    # ------------------------------------------------------------------ requests

    def model_step(self, input_ids: torch.Tensor, ctx) -> tuple[torch.Tensor, ...]:
        """(hidden, logits[, samples]): with ``ctx.sample_keys`` the step samples its logits rows on
        the device too (inside a CUDA graph when it replays one)."""
        hidden, logits = self.model(input_ids, ctx, self.cache.main)
        if ctx.sample_keys is None:
            return hidden, logits
        return hidden, logits, self.model.sampler.sample_device(logits, ctx.sample_keys, ctx.temperatures)

    def make_batch(self, token_ids: list[list[int]], seqs: list[Sequence], is_recurrent: list[bool],
                   logits_rows: list[list[int]], *, sample_positions: list[list[int]] | None = None,
                   past_lens: list[int] | None = None, runner=None):
        """Input ids and context of a step over ``token_ids[i]`` of ``seqs[i]`` (from position
        ``past_lens[i]``, default its ``num_computed``), packed by ``runner`` (default the main
        model's). ``sample_positions[i]``: the position each of sequence i's logits rows samples
        (its randomness key), so the step can sample on the device."""
        past = [s.num_computed for s in seqs] if past_lens is None else past_lens
        keys = temps = None
        if sample_positions is not None:
            keys = [mix_seed(s.seed, p) for s, ps in zip(seqs, sample_positions) for p in ps]
            temps = [s.params.temperature for s, ps in zip(seqs, sample_positions) for _ in ps]
        hb = plan_batch(token_ids, past, [s.blocks for s in seqs], [s.state_slot for s in seqs], is_recurrent,
                        block_size=self.cache.block_size, ring=self.cache.state_ring, logits_rows=logits_rows,
                        sample_keys=keys, temperatures=temps)
        return (runner or self.runner).make_context(hb, self.device)

    def run_model(self, input_ids: torch.Tensor, ctx, ids_from: torch.Tensor | None = None) -> StepOutput:
        """The main model over one step's tokens, through the graph runner. ``ids_from``: the
        input ids are row indices into it (a previous step's device samples; see ``gather_ids``)."""
        return StepOutput(*self.runner.run(self.model_step, input_ids, ctx, self.model.prepare_step,
                                           ids_from=ids_from))

    def _token_ids(self, prompt: Prompt, what: str = "prompt") -> list[int]:
        """A prompt's ids as Python ints: text is tokenized; ids may be Python, numpy or torch
        integers (a list of them, or a 1-D array or tensor)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{what} is text but this checkpoint has no tokenizer; pass a list of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = _as_ints(prompt, what)
        if not ids:
            raise RequestError(f"{what} is empty")
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise RequestError(f"{what} has token ids outside the vocabulary [0, {self.args.vocab_size}): {bad[:5]}")
        return ids

    def _new_seq(self, ids: list[int], params: SamplingParams, max_total_len: int, seed: int | None = None,
                 **fields) -> Sequence:
        rid = self._next_id
        self._next_id += 1
        if seed is None:
            seed = params.seed if params.seed is not None else mix_seed(self.config.seed, rid)
        seq = Sequence(request_id=rid, prompt_ids=ids, params=params, seed=seed, max_total_len=max_total_len,
                       weight_version=self.weight_version, **fields)
        self.requests[rid] = seq
        return seq

    def _enqueue(self, ids: list[int], params: SamplingParams, max_total_len: int, **fields) -> Sequence:
        seq = self._new_seq(ids, params, max_total_len, **fields)
        self.scheduler.add(seq)
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
        max_total = min(len(ids) + params.max_new_tokens, self.max_model_len)
        self._check_group(params.n)
        seq = self._enqueue(ids, params, max_total, score_top=params.prompt_logprobs or 0)
        seq.group = [seq]
        for i in range(1, params.n):  # the other samples wait attached to the leader until it forks them
            f = self._new_seq(ids, params, max_total, seed=sample_seed(seq.seed, i), sample_index=i, leader=seq,
                              score_top=seq.score_top)
            seq.followers.append(f)
            seq.group.append(f)
        if (text or params.stop) and self.tokenizer is not None:
            for member in seq.group:
                member.text = TextStream(self.tokenizer, params.stop)
        self._mirror("add_request", prompt, params, text=text)
        return seq

    def _check_group(self, n: int) -> None:
        """n samples are admitted together: they must fit in the slots at once."""
        limit = self.config.scheduler.max_num_seqs
        if n > limit:
            raise RequestError(f"n={n} samples exceed scheduler.max_num_seqs={limit} (the samples of a prompt run "
                               "together); lower n or raise scheduler.max_num_seqs")

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
        seq = self._enqueue(ids + cont, SamplingParams(max_new_tokens=1), total, score_from=len(ids), exact=exact,
                            score_top=logprobs)
        self._mirror("add_score_request", prompt, continuation, exact=exact, logprobs=logprobs)
        return seq

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request (``finish_reason='abort'``); its KV pages and state slot are
        free for the next step. False if there is no such request. Call between steps."""
        self._mirror("abort", request_id)
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        for f in list(seq.followers):  # samples not yet forked cannot run without their leader
            self.abort(f.request_id)
        self.scheduler.abort(seq)
        self.strategy.forget(seq)
        seq.finish("abort")
        return True

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it."""
        if not self.scheduler.has_work():
            return []
        if self._driver is not None:
            self._driver.send_step(self.lockstep_check())
        self.num_steps += 1
        # the live rows of a decode step the last call launched ahead (strategies/ar.py), else a schedule
        ahead = self.strategy.launched()
        scheduled = ahead or self.scheduler.schedule()
        if not scheduled:
            raise BiEngineError("internal: the scheduler could not place any request (cache too small?)")
        self._forked = []
        # prompt chunks (and recomputes): decode rows need none of what follows the step
        chunks = [] if ahead else [(s.seq, s.seq.num_computed, s.recurrent) for s in scheduled if not s.seq.is_decoding]
        with torch.inference_mode(), applied(self.policy):
            self.strategy.step(scheduled)
        self._after_chunks(chunks)
        done = [seq for seq in [s.seq for s in scheduled] + self._forked if seq.status is Status.FINISHED]
        for seq in done:
            self.scheduler.finish(seq)
            self.strategy.forget(seq)
            self.requests.pop(seq.request_id, None)
        return done

    def _after_chunks(self, chunks: list[tuple[Sequence, int, bool]]) -> None:
        """After a step, for each sequence that ran a chunk from ``start``: count its prompt
        tokens; hand the prefix cache a chunk on the chunk grid (chunked form, continuing what the
        sequence already cached) with the GDN state after it; end a scoring request whose last
        scored row has run."""
        prefix = self.cache.prefix
        for seq, start, recurrent in chunks:
            end = seq.num_computed
            self.num_prompt_tokens_computed += max(0, min(end, len(seq.prompt_ids)) - start)
            if (prefix is not None and not recurrent and seq.state_slot is not None and start == seq.prefix_end
                    and prefix.cacheable(start, end)):
                prefix.insert(seq, end, self.cache.state_at(seq.state_slot, end))
            if seq.score_from is not None and end >= seq.compute_end:
                seq.finish("length")

    def record_scores(self, scheduled: list[Scheduled], hidden: torch.Tensor, offsets: list[int]) -> None:
        """Logprobs of known tokens (scoring, prompt logprobs) from this step's hidden rows; call it
        before the sequences' ``num_computed`` moves past the step. Logits are computed in blocks
        of rows, so a long chunk never holds chunk x vocabulary logits at once; with a row-invariant
        lm_head the block size changes no bit."""
        rows, targets, owners = [], [], []
        for s, offset in zip(scheduled, offsets):
            span = s.seq.scored
            if span is None:
                continue
            start, ids = s.seq.num_computed, s.seq.all_ids
            done = span[0] + len(s.seq.scored_logprobs)  # kept across a preemption's recompute
            # the row at position j - 1 gives the logprob of the token at position j
            for j in range(max(done, start + 1), min(span[1], start + s.num_tokens + 1)):
                rows.append(offset + j - 1 - start)
                targets.append(ids[j])
                owners.append(s.seq)
        for b in range(0, len(rows), SCORE_BLOCK):
            seqs = owners[b:b + SCORE_BLOCK]
            top = max(s.score_top for s in seqs)
            logits = self.model.compute_logits(hidden[torch.tensor(rows[b:b + SCORE_BLOCK], device=self.device)])
            out = self.model.sampler.logprobs_of(logits, torch.tensor(targets[b:b + SCORE_BLOCK], device=self.device),
                                                 top).to_host()
            tokens, lps = out[:, 0].long().tolist(), out[:, 1].float().tolist()
            top_ids, top_lps = out[:, 2:2 + top].long().tolist(), out[:, 2 + top:].float().tolist()
            for i, seq in enumerate(seqs):
                entry = dict(zip(top_ids[i][:seq.score_top], top_lps[i][:seq.score_top]))
                entry[tokens[i]] = lps[i]
                seq.scored_logprobs.append(lps[i])
                seq.scored_top.append(entry)

    def sample_rows(self, seqs: list[Sequence], positions: list[int], logits: torch.Tensor,
                    samples: torch.Tensor | None = None):
        """Sample one token per logits row; row i belongs to ``seqs[i]`` and samples the token at
        ``positions[i]`` (its randomness is keyed by that request's seed and that position).
        ``samples``: the step's own device samples of these rows (used unless a request wants
        top-k/top-p filtering or top-N logprobs, which the sampler does row by row).
        Returns per row (token, logprob, top-N dict or None)."""
        if self.on_logits is not None:
            self.on_logits(seqs, logits)
        n = max((s.params.logprobs or 0) for s in seqs)
        if samples is not None and device_sampled(seqs):
            packed = samples.cpu()
        else:
            packed = self.model.sampler.forward(logits, self.sampling_batch(seqs, positions, n)).to_host()
        return self.rows_of(seqs, packed, n)

    def rows_of(self, seqs: list[Sequence], packed: torch.Tensor, n: int = 0):
        """Per row of a host ``packed`` sample tensor [R, 2 + 2n] (token, logprob, top-N ids, top-N
        logprobs): (token, logprob, top-N dict or None) as ``Sequence.append`` takes them."""
        tokens, lps = packed[:, 0].long().tolist(), packed[:, 1].float().tolist()
        top_ids, top_lps = packed[:, 2:2 + n].long().tolist(), packed[:, 2 + n:].float().tolist()
        rows = []
        for i, seq in enumerate(seqs):
            top = None
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = dict(zip(top_ids[i][:k], top_lps[i][:k]))
                top[tokens[i]] = lps[i]
            rows.append((tokens[i], lps[i], top))
        return rows

    def sample_and_append(self, seqs: list[Sequence], out: StepOutput) -> None:
        """One new token per sequence (autoregressive step); a leader's other samples are forked
        from it and sample their first token from the same logits row."""
        rows = self.sample_rows(seqs, [s.num_tokens for s in seqs], out.logits, out.samples)
        for seq, (token, lp, top) in zip(seqs, rows):
            seq.append(token, lp, top, self.eos_ids)
        for i, seq in enumerate(seqs):
            if seq.followers:
                self.fork(seq, out.logits[i])

    def fork(self, leader: Sequence, logits_row: torch.Tensor) -> list[Sequence]:
        """Give each of ``leader``'s waiting samples what a lone prefill of the prompt computes:
        the shared pages (wholly before the last prompt token) by reference, the page holding the
        last prompt token and the GDN states by copy; then its first token, sampled from the
        logits row the leader's first token came from with its own seed (the sampler is
        row-invariant: what the sample would draw sent alone). Call it once the leader's last
        prompt chunk has run (and, with MTP, the head over it)."""
        fs, leader.followers = leader.followers, []
        prompt_len = len(leader.prompt_ids)
        first = self.sample_rows(fs, [prompt_len] * len(fs), logits_row.expand(len(fs), -1).contiguous())
        shared = self.scheduler.shared_pages(prompt_len)
        self.cache.copy_pages([leader.blocks[shared]] * len(fs), [f.blocks[0] for f in fs])
        self.cache.copy_states([self.cache.state_at(leader.state_slot, prompt_len)] * len(fs),
                               [self.cache.state_at(f.state_slot, prompt_len) for f in fs])
        for f, (token, lp, top) in zip(fs, first):
            f.blocks = self.cache.blocks.share(leader.blocks[:shared]) + f.blocks
            f.leader, f.num_computed = None, prompt_len
            f.scored_logprobs, f.scored_top = list(leader.scored_logprobs), list(leader.scored_top)
            f.append(token, lp, top, self.eos_ids)
        self._forked += fs
        return fs

    def sampling_batch(self, seqs: list[Sequence], positions: list[int], num_logprobs: int) -> SamplingBatch:
        return SamplingBatch(
            temperatures=[s.params.temperature for s in seqs],
            top_ks=[s.params.top_k for s in seqs],
            top_ps=[s.params.top_p for s in seqs],
            keys=[mix_seed(s.seed, p) for s, p in zip(seqs, positions)],
            num_logprobs=num_logprobs,
        )

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
                self._driver.send_now("update_weights", (str(weights),), {})  # each rank reads its shard
            else:
                self._driver.send_weights(source, [st.name for st in steps], self.device)
        count = apply_update(self.model, source, steps)
        self._after_update()
        return count

    def receive_weights(self, meta: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Tensor-parallel rank > 0: rank 0's ``update_weights`` tensors, received one at a time
        (rank 0 checked them all first) and copied into this rank's shard."""
        from bi_core.parallel.lockstep import receive_tensor

        for name, shape, dtype in meta:
            update_weights(self.model, TensorDict([(name, receive_tensor(shape, dtype, self.device))]))
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
        prompts = [prompts] if _is_one_prompt(prompts) else list(prompts)
        params = params or SamplingParams()
        per_request = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(per_request)} SamplingParams")
        seqs: list[Sequence | tuple[list[int], str]] = []
        for prompt, p in zip(prompts, per_request):
            try:
                seqs.append(self.add_request(prompt, p))
            except RequestError as e:
                seqs.append((_ids_or_empty(prompt), str(e)))
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
        prompts = [prompts] if _is_one_prompt(prompts) else list(prompts)
        continuations = [continuations] if _is_one_prompt(continuations) else list(continuations)
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
            samples = [self._output(x) for x in s.group]
            return attrs.evolve(samples[0], samples=samples)
        return self._output(s)

    def _output(self, s: Sequence) -> RequestOutput:
        text = s.text.text if s.text is not None else self.tokenizer.decode(s.output_ids) if self.tokenizer else None
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_ids, token_ids=list(s.output_ids), text=text,
            token_logprobs=list(s.token_logprobs),
            logprobs=list(s.top_logprobs) if s.params.logprobs is not None else None,
            finish_reason=s.finish_reason, error=s.error, stop_reason=s.stop_reason, num_preemptions=s.num_preemptions,
            num_accepted_draft_tokens=s.num_accepted_draft_tokens, num_draft_tokens=s.num_draft_tokens,
            num_verify_steps=s.num_verify_steps, weight_version=s.weight_version,
            prompt_logprobs=[None, *s.scored_top] if s.params.prompt_logprobs is not None else None,
            sample_index=s.sample_index, num_cached_tokens=s.num_cached_tokens)


@attrs.frozen(kw_only=True)
class ScoreOutput:
    """The logprobs of a continuation after a prompt (``LLMEngine.score``)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # the continuation
    token_logprobs: list[float]  # log p of each continuation token given everything before it
    logprobs: list[dict[int, float]] | None  # per token: top-N and the token itself (when asked for)
    exact: bool
    weight_version: int = 0
    error: str | None = None

    @classmethod
    def of(cls, s: Sequence | str, exact: bool) -> ScoreOutput:
        if not isinstance(s, Sequence):
            return cls(request_id=-1, prompt_token_ids=[], token_ids=[], token_logprobs=[], logprobs=None,
                       exact=exact, error=s)
        cut = s.score_from
        return cls(request_id=s.request_id, prompt_token_ids=s.prompt_ids[:cut], token_ids=s.prompt_ids[cut:],
                   token_logprobs=list(s.scored_logprobs), logprobs=list(s.scored_top) if s.score_top else None,
                   exact=s.exact, weight_version=s.weight_version, error=s.error)


@attrs.frozen
class StepOutput:
    """What a model step returns: every token's hidden state, the logits of the rows it was asked
    for, and (when the context carried sampling keys) those rows sampled on the device."""

    hidden: torch.Tensor
    logits: torch.Tensor
    samples: torch.Tensor | None = None  # [R, 2] float64 (token, logprob)


def _is_token_id(t) -> bool:
    """An integer of Python, numpy or torch (a 0-d tensor); not a bool."""
    if isinstance(t, bool) or str(getattr(t, "dtype", "")) in ("bool", "torch.bool"):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def _as_ints(prompt, what: str) -> list[int]:
    """Token ids as Python ints; RequestError names what is not one."""
    ndim = getattr(prompt, "ndim", None)
    if ndim is not None:  # a numpy array or torch tensor: converted in one call
        if ndim != 1:
            raise RequestError(f"{what} must be a 1-D array of token ids, got {ndim} dimensions")
        ids = prompt.tolist()
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise RequestError(f"{what} must be a str or a sequence of token ids, got {type(prompt).__name__}")
    else:
        ids = list(prompt)
    bad = [t for t in ids if not _is_token_id(t)]
    if bad:
        raise RequestError(f"{what} has token ids that are not integers: {bad[:5]!r}")
    return [operator.index(t) for t in ids]


def _is_one_prompt(prompts) -> bool:
    """A lone str, or a flat sequence of token ids (whose first element is an integer); anything
    that is no sequence of prompts is one (bad) prompt, which its result names."""
    if isinstance(prompts, str) or getattr(prompts, "ndim", 2) < 2 or not isinstance(prompts, Iterable):
        return True
    return isinstance(prompts, Seq) and len(prompts) > 0 and _is_token_id(prompts[0])


def _ids_or_empty(prompt) -> list[int]:
    """A refused prompt's ids for its error result, where it has valid ones."""
    try:
        return [] if isinstance(prompt, str) else _as_ints(prompt, "prompt")
    except RequestError:
        return []


def _prefix_caching(config: EngineConfig, strategy_cls, chunk: int) -> bool:
    """Whether prefix caching is on; raises when it was asked for where it cannot be exact."""
    wanted = config.cache.prefix_caching
    if strategy_cls.is_speculative:
        if wanted is True:
            raise ConfigError("cache.prefix_caching", f"not with strategy {strategy_cls.name}: the MTP head's KV at a "
                              "page's last position depends on the token after the page, which a later request may "
                              "not share; use auto or false")
        return False
    if wanted is False:
        return False
    block = config.cache.block_size
    if chunk % block:
        if wanted is True:
            raise ConfigError("cache.prefix_caching", f"needs scheduler.prefill_chunk_size ({chunk}) to be a "
                              f"multiple of cache.block_size ({block}): cached prefixes end on chunk boundaries")
        return False
    return True


def _param_gib(args: ModelArgs, dtype: torch.dtype) -> float:
    """Approximate weight size: embeddings, head, and every layer's projections and experts."""
    h = args.hidden_size
    per_layer = 4 * h * args.num_attention_heads * args.head_dim  # attention-sized projections
    if args.is_moe:
        per_layer += 3 * args.num_experts * h * args.moe_intermediate_size + 3 * h * args.shared_expert_intermediate_size
    else:
        per_layer += 3 * h * (args.intermediate_size or 0)
    heads = 1 if args.tie_word_embeddings else 2
    return (heads * args.vocab_size * h + args.num_hidden_layers * per_layer) * dtype.itemsize / 2**30


def explain(config: EngineConfig, registry: Registry | None = None) -> str:
    """Which builder serves each op and why the others were refused, without loading weights or
    building anything."""
    wanted = planned_device(config.model.device)
    live = wanted.type != "cuda" or torch.cuda.is_available()
    _, _, factory = prepare(config, registry, live=live, plan_only=True)
    args, index = resolve_model(config)
    with_mtp = index.has_prefix("mtp.") if index is not None else args.mtp_num_hidden_layers > 0
    world = config.parallel.tensor_parallel_size
    check_tensor_parallel(args, world)
    Qwen35Model(args, factory, factory.base["dtype"], torch.device("meta"), with_mtp=with_mtp, tp=TPInfo(0, world))
    factory.build("graph_runner", GraphRunnerSpec(**factory.base, use_graphs=config.graph.enabled,
                                                  max_batch_size=config.scheduler.max_num_seqs))
    failure = "\n".join(dict.fromkeys(factory.failures()))
    text = factory.explain()
    if not live:
        text = (f"note: {wanted} is not available on this machine: the plan is shown as selected for it, without "
                "the checks that need the device present (CUDA, SM90); package checks are this machine's\n" + text)
    return text + ("\n\nSELECTION FAILED:\n" + failure if failure else "")


