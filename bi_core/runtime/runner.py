"""The model runner: executes one forward plan over the model (or its MTP head) and samples.

It owns the model, the cache tensors, the graph runners (one for the main model, one for the MTP
head) and batch packing; strategies hand it a ``Forward`` (which tokens of which sequences, from
which positions, which rows to sample) and get a ``StepOutput`` back (the values: ``step.py``). It never writes sequence
state: what a step did to each sequence is the strategy's ``StepCommit``, applied by the
scheduler (``Scheduler.update``)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from bi_core.ops.context import ForwardContext, GraphShape
from bi_core.ops.sampling import device_sampled, mix_seed
from bi_core.runtime import gc_heap
from bi_core.runtime.batch import plan_batch
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.grammar_masks import DeviceMasks
from bi_core.runtime.graphs import GraphRunnerSpec, graph_runner
from bi_core.runtime.host_buffer import HostBuffer
from bi_core.runtime.multimodal import encode, mrope_axes
from bi_core.runtime.sampling_batch import sampling_batch
from bi_core.runtime.sequence import Sequence
from bi_core.runtime.step import Forward, Landing, Sampled, SeqRows, StepOutput

SCORE_BLOCK = 256  # logits rows computed at once when scoring


class HeadSteps:
    """What a head program's body runs on the device (``ModelRunner.head_program``): the MTP
    head's steps over its uniform graphs' static buffers, whose contexts the body gets."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner, self._graphs = runner, runner.mtp_graphs

    def inputs(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's token ids [rows] and main-model hidden rows [rows, H], to write."""
        return self._graphs.static_inputs(ctx)

    def run(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over every row of the step: (its hidden rows, each row's greedy draft)."""
        return self._graphs.direct(self._runner._mtp_step, ctx)

    def shift(self, ctx: ForwardContext, by: torch.Tensor) -> ForwardContext:
        """A one-token step's first ``len(by)`` sequences moved ``by`` positions on, on the device."""
        return self._graphs.shift(ctx, by)

    def advance(self, ctx: ForwardContext) -> ForwardContext:
        """The next one-token step of the same sequences, one position further, on the device."""
        return self._graphs.advance(ctx)


class ModelRunner:
    def __init__(self, model, cache: CacheManager, spec: GraphRunnerSpec, *, with_mtp_graphs: bool = False) -> None:
        """``spec``: how the main model's steps are launched (eager, CUDA graphs or their rerun
        mode: ``runtime/graphs``); the MTP head's runner follows it (``mtp_graph_spec``)."""
        self.model, self.cache, self.spec = model, cache, spec
        self.device = spec.device
        self.main_graphs = graph_runner(spec)
        self.mtp_graphs = graph_runner(mtp_graph_spec(spec)) if with_mtp_graphs else None
        self.sleeping: set[str] = set()  # what sleep released and wake_up has not restored: weights, kv_cache
        self.sleep_level = 0
        self._host: HostBuffer | None = None  # level 1's host copy of the weights, kept between sleeps
        self._host_saved = False  # it holds the weights of the current sleep
        self.on_logits: Callable | None = None  # debugging hook: called with (sequences, logits) before sampling
        self._landing: list[torch.Tensor] = []  # two host buffers for samples in flight, used in turn
        self._turn = 0
        self.routing: torch.Tensor | None = None  # [moe layers, max tokens, k]: the step's expert ids
        self._mtp_last = None  # (input ids, context, host batch) of the MTP head's last step (advance_mtp)
        self.vision = None  # the vision tower (models/vision_tower.py), where the engine takes images
        args = model.args
        self.mrope_axes = mrope_axes(args.mrope_section, args.mrope_interleaved, args.rotary_dim // 2)
        self._masks: DeviceMasks | None = None  # structured outputs' mask buffers, at the first constrained step

    def record_routing(self, max_tokens: int) -> None:
        """Have every MoE layer log its top-k expert ids (routing replay): before graphs are captured."""
        layers = len(self.model.moe_layers())
        self.routing = torch.zeros((layers, max_tokens, self.model.args.num_experts_per_tok), dtype=torch.int64,
                                   device=self.device)
        self.model.log_routing(self.routing)

    # ------------------------------------------------------------------ forwards

    @property
    def shifts_on_device(self) -> bool:
        """Whether a head graph's positions can move by amounts only the device knows (a head
        program's chain, moved by the accept count): no attention impl re-plans a replay from
        host-side lengths (FlashInfer does), or the host mirrors can be read for free (a CPU)."""
        shift = getattr(self.mtp_graphs, "shift", None)
        return shift is not None and (self.device.type == "cpu" or not self.model.plans_from_host_lengths)

    def execute(self, fwd: Forward) -> StepOutput:
        """Pack ``fwd`` (straight into a graph's static buffers when one replays it) and run it."""
        graphs = self.main_graphs if fwd.head == "model" else self.mtp_graphs
        hb = self._host_batch(fwd)
        input_ids, ctx = graphs.make_context(hb, self.device)
        if fwd.head == "model":
            outs = graphs.run(self._model_step, input_ids, ctx, self.model.prepare_step, ids_from=fwd.ids_from)
        else:
            outs = graphs.run(self._mtp_step, input_ids, ctx, self.model.prepare_step, extra=fwd.hidden,
                              ids_from=fwd.ids_from)
            self._mtp_last = (input_ids, ctx, hb)
        samples = outs[2] if len(outs) > 2 else None
        routed = None
        if self.routing is not None and fwd.head == "model" and any(r.seq.params.return_routed_experts
                                                                    for r in fwd.rows):
            # this step's rows (a mixed graph's chunk sits after its padding), before the next step writes the buffer
            spans = (ctx.graph.spans(len(fwd.rows), len(fwd.rows[-1].tokens)) if ctx.graph is not None
                     else [(0, fwd.num_tokens)])
            routed = torch.cat([self.routing[:, a:b] for a, b in spans], dim=1)
        return StepOutput(outs[0], outs[1], samples, hb.cu_seqlens[:-1], ctx.graph, routed, input_ids)

    def advance_mtp(self, ids: torch.Tensor, hidden: torch.Tensor) -> StepOutput | None:
        """The MTP head's next one-token step for the sequences of its last step (a draft chain's
        step j + 1 after step j), each at the next position, with tokens ``ids`` [S] and main
        hidden rows ``hidden`` [S, H] (S: the last step's sequences), prepared on the device
        where the last step replayed a one-token graph (``advance`` of the graph runner): no
        host packing, no transfer, so the host stays ahead of the chain. None where it cannot
        (an eager step): run ``execute`` instead. Logits rows: one per sequence, as before."""
        advance = getattr(self.mtp_graphs, "advance", None)
        if advance is None or self._mtp_last is None:
            return None
        input_ids, ctx, hb = self._mtp_last
        nxt = advance(ctx)
        if nxt is None:
            return None
        assert ids.shape[0] == hb.num_seqs and hb.logits_rows == list(range(hb.num_seqs)), \
            "advance_mtp: one token and one logits row per sequence of the last step"
        input_ids[: ids.shape[0]].copy_(ids)
        outs = self.mtp_graphs.run(self._mtp_step, input_ids, nxt, self.model.prepare_step, extra=hidden)
        self._mtp_last = (input_ids, nxt, hb)
        return StepOutput(outs[0], outs[1], None, hb.cu_seqlens[:-1], nxt.graph)

    @property
    def runs_head_programs(self) -> bool:
        """Whether MTP head steps can run as one program (``head_program``): head graphs whose
        positions move on the device."""
        return self.shifts_on_device and hasattr(self.mtp_graphs, "program")

    def captured_shapes(self, q_len: int) -> list[GraphShape]:
        """The uniform main-model graphs of ``q_len`` tokens a sequence captured so far."""
        return [GraphShape(*key) for key in getattr(self.main_graphs, "graphs", {}) if key[:1] == (q_len,)
                and len(key) == 2]

    def whole(self, shape: GraphShape) -> tuple[torch.Tensor, ...]:
        """(input ids, hidden, logits, samples) of the uniform main-model graph of ``shape`` as its
        last replay left them, every row of its bucket (padding included), at the addresses its
        replays write: what a head program reads (``head_program``)."""
        return self.main_graphs.whole(shape)

    def head_program(self, name: str, steps: list[Forward], inputs: tuple[torch.Tensor, ...],
                     body: Callable[..., tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """MTP head steps and the device work between them as one program, one CUDA graph where
        the head's graphs are captured (``CudaGraphRunner.program``, under ``name``): each of
        ``steps`` (uniform head steps; their token ids are placeholders) is packed into its
        graph's static buffers, then ``body(head, ctxs, *inputs)`` runs on the device: ``head``
        a ``HeadSteps``, ``ctxs`` the steps' static contexts. ``inputs``: the device tensors the
        body reads besides them (the same tensors every step, e.g. ``whole``'s), which it must
        not write. Only where ``runs_head_programs``."""
        graphs, ctxs = self.mtp_graphs, []
        for fwd in steps:
            _, ctx = graphs.make_context(self._host_batch(fwd), self.device)
            assert ctx.graph is not None and not ctx.graph.chunk, "head_program: steps of uniform head graphs"
            ctxs.append(ctx)
        head = HeadSteps(self)
        self._mtp_last = None  # the program moves its steps' positions: advance_mtp continues execute's steps only
        return graphs.program(name, ctxs, lambda c, *args: body(head, c, *args), inputs, self.model.prepare_step,
                              extra=self._hidden_like())

    def capture_head_program(self, name: str, shapes: list[GraphShape], inputs: tuple[torch.Tensor, ...],
                             body: Callable[..., tuple[torch.Tensor, ...]]) -> bool:
        """``head_program``'s graph for steps of ``shapes``, captured now (at engine start) on
        padding rows; False where nothing is captured (eager head, rerun stand-in)."""
        head = HeadSteps(self)
        return self.mtp_graphs.capture_program(name, [s.key for s in shapes], lambda c, *args: body(head, c, *args),
                                               inputs, self.cache.block_size, self.model.prepare_step,
                                               extra=self._hidden_like())

    def _hidden_like(self) -> torch.Tensor:
        """An empty tensor shaped and typed as the main model's hidden rows (the head's per-token input)."""
        return torch.empty((0, self.model.args.hidden_size), dtype=self.spec.dtype, device=self.device)

    def _host_batch(self, fwd: Forward):
        rows = fwd.rows
        sampled = [r for r in rows if r.sample]
        keys = temps = None
        if sampled:
            keys = [mix_seed(r.seq.seed, p) for r in rows if r.sample for p in r.sample_positions]
            temps = [r.seq.params.temperature for r in rows if r.sample for _ in r.logits_rows]
            assert len(sampled) == len([r for r in rows if r.logits_rows]), "a step samples all its logits rows or none"
        mm = {}
        if any(r.seq.mm is not None for r in rows):
            encode(self.vision, [r.seq.mm for r in rows], self.device)  # normally done between steps (vision_encode.py)
            mm = {"mm": [r.seq.mm for r in rows], "mrope_axes": self.mrope_axes,
                  "embed_shift": 1 if fwd.head == "mtp" else 0}
        return plan_batch([r.tokens for r in rows], [r.start for r in rows], [r.seq.blocks for r in rows],
                          [r.seq.state_slot for r in rows], [r.recurrent for r in rows],
                          block_size=self.cache.block_size, ring=self.cache.state_ring,
                          logits_rows=[list(r.logits_rows) for r in rows], sample_keys=keys, temperatures=temps,
                          lora_slots=[r.seq.lora_slot for r in rows] if self.spec.lora else None, **mm)


    def _model_step(self, input_ids: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        """(hidden, logits[, samples]): with ``ctx.sample_keys`` the step samples its logits rows on
        the device too (inside a CUDA graph when it replays one)."""
        hidden, logits = self.model(input_ids, ctx, self.cache.main)
        if ctx.sample_keys is None:
            return hidden, logits
        return hidden, logits, self.model.sampler.sample_device(logits, ctx.sample_keys, ctx.temperatures)

    def _mtp_step(self, ids: torch.Tensor, ctx: ForwardContext, hidden: torch.Tensor):
        return self.model.mtp_forward(ids, hidden, ctx, self.cache.mtp)

    def capture_graphs(self) -> int:
        """Capture every CUDA graph the steps will replay (at engine start); returns how many."""
        n = self.main_graphs.capture_all(self._model_step, self.cache.block_size, self.model.prepare_step)
        if self.mtp_graphs is not None:
            n += self.mtp_graphs.capture_all(self._mtp_step, self.cache.block_size, self.model.prepare_step,
                                             extra=self._hidden_like())
        return n

    def wait_inputs(self) -> None:
        """The last launched step's staged inputs have left the host (its buffers are free)."""
        self.main_graphs.wait_inputs()

    def land(self, samples: torch.Tensor) -> Landing:
        """Queue the copy of a launched step's device samples to the host, behind the step."""
        if not self._landing:  # a uniform step's rows at most (MTP verify: 1 + N a sequence)
            size = (self.spec.max_batch_size * max(self.spec.query_lens), 2)
            self._landing = [torch.empty(size, dtype=torch.float64, pin_memory=samples.is_cuda) for _ in range(2)]
        host = self._landing[self._turn][: samples.shape[0]]
        self._turn ^= 1
        return self.to_host(samples, host)

    def to_host(self, t: torch.Tensor, host: torch.Tensor | None = None) -> Landing:
        """Queue the copy of a device tensor to page-locked host memory (``host``, or fresh),
        behind the work that produces it (``Landing.wait`` returns the host copy)."""
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=True)
        ready = None
        if t.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return Landing(t, host, ready)

    # ------------------------------------------------------------------ sleep / wake (RL: a colocated trainer)

    def sleep(self, level: int) -> None:
        """Release device memory: the cache tensors and the CUDA graphs (their pools and static
        buffers), and the weights: level 1 copies them to page-locked host memory (one buffer,
        pinned at the first sleep and kept for the next: ``HostBuffer``), level 2 drops them (a
        weight update refills them after ``wake_up(["weights"])``) and frees that host buffer.
        Tensors keep their shapes; their storage goes. Call with no request unfinished."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleeping:
            raise RuntimeError(f"already asleep ({', '.join(sorted(self.sleeping))}); wake_up first")
        self._drop_graphs()
        self.cache.release()
        weights = self._weights()
        self._host_saved = False
        if level == 1:
            if self._host is None or not self._host.fits(weights):
                self._host = None  # the old buffer goes before a new one is pinned (never two at once)
                self._host = HostBuffer(weights)
            self._host.save(weights)
            self._host_saved = True
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies are asynchronous: done before the storage goes
        else:
            self._host = None
        for t in weights:
            t.untyped_storage().resize_(0)
        self.sleeping = {"weights", "kv_cache"}
        self.sleep_level = level
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate again what ``sleep`` released: ``tags`` "weights" (level 1: copied back from
        host memory; level 2: uninitialised until a weight update fills them) and/or "kv_cache"
        (zeroed caches); None = both. Sleep forgot the CUDA graphs (they replay the old
        addresses): they are captured again on first use, or all at once by ``capture_graphs``
        (the engine's wake_up does that, as at start)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        bad = sorted(set(tags) - {"weights", "kv_cache"})
        if bad:
            raise ValueError(f"wake_up tags must be among weights, kv_cache; got {bad}")
        if "weights" in tags and "weights" in self.sleeping:
            weights = self._weights()
            for t in weights:
                t.untyped_storage().resize_(t.numel() * t.element_size())
            if self._host_saved:
                self._host.load(weights)
            self._host_saved = False
            self.model.refresh_draft_head()
            self.sleeping.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            self.cache.restore()
            self.sleeping.discard("kv_cache")

    def _weights(self) -> list[torch.Tensor]:
        """The device tensors a weight update writes (parameters), and the draft head's rows."""
        tensors = [p for p in self.model.parameters()]
        return tensors + ([self.model.draft_weight] if self.model.draft_weight is not None else [])

    def _drop_graphs(self) -> None:
        """Forget every captured graph (they replay the addresses of the weights and caches they
        were captured with); the next uniform steps capture again. The graph runners themselves
        stay (their buckets and counters)."""
        for graphs in filter(None, (self.main_graphs, self.mtp_graphs)):
            graphs.release()
        gc_heap.collect(refreeze=True)

    # ------------------------------------------------------------------ sampling and scoring

    def mask_samples(self, fwd: Forward, out: StepOutput) -> StepOutput:
        """``out`` with its constrained rows' device samples drawn again with their grammar
        masks, filled on the host now (while the device runs the step), ``masked`` set; ``out``
        where its samples would not serve its rows anyway (``runtime/grammar_masks.py``)."""
        if out.samples is None or not any(r.seq.grammar is not None for r in fwd.rows):
            return out
        if self._masks is None:
            rows = max(self.spec.max_batch_size, len([r for r in fwd.rows if r.sample]))
            self._masks = DeviceMasks(self.model.sampler, self.device, rows, out.logits.shape[-1])
        return self._masks.apply(fwd, out)

    @property
    def num_masked_rows(self) -> int:
        """Constrained rows whose device samples were drawn with their masks so far."""
        return self._masks.num_rows if self._masks is not None else 0

    def sample(self, seqs: list[Sequence], positions: list[int], logits: torch.Tensor,
               samples: torch.Tensor | None = None, before: list[list[int]] | None = None,
               masked: bool = False) -> list[Sampled]:
        """Sample one token per logits row; row i belongs to ``seqs[i]`` and samples the token at
        ``positions[i]`` (its randomness is keyed by that request's seed and that position).
        ``samples``: the step's own device samples of these rows (used unless a request wants
        filtering, adjusted logits or top-N logprobs, which the sampler does row by row).
        ``before[i]``: tokens between the sequence's known ones and ``positions[i]`` (MTP's
        drafts before a verify row), which its penalties count. ``masked``: ``samples``' constrained
        rows were drawn with their masks (``mask_samples``)."""
        if self.on_logits is not None:
            self.on_logits(seqs, logits)
        n = max((s.params.logprobs or 0) for s in seqs)
        if samples is not None and device_sampled(seqs, masked):
            packed = samples.cpu()
        else:
            batch = sampling_batch(seqs, positions, n, self.model.args.eos_token_ids, logits.shape[-1], before)
            packed = self.model.sampler.forward(logits, batch).to_host()
        return rows_of(seqs, packed, n)

    def score(self, rows: list[SeqRows], out: StepOutput) -> list[tuple[Sequence, float, dict[int, float]]]:
        """Logprobs of known tokens (scoring, prompt logprobs) from a step's hidden rows, in
        position order per sequence: (sequence, logprob, its top-N dict with the token). Logits
        are computed in blocks of rows, so a long chunk never holds chunk x vocabulary logits at
        once; with a row-invariant lm_head the block size changes no bit."""
        flat, targets, owners = [], [], []
        for r, offset in zip(rows, out.offsets):
            seq, span = r.seq, r.seq.scored
            if span is None:
                continue
            done = span[0] + len(seq.scored_logprobs)  # kept across a preemption's recompute
            ids = seq.all_ids
            # the row at position j - 1 gives the logprob of the token at position j
            for j in range(max(done, r.start + 1), min(span[1], r.start + len(r.tokens) + 1)):
                flat.append(offset + j - 1 - r.start)
                targets.append(ids[j])
                owners.append(seq)
        scores = []
        for b in range(0, len(flat), SCORE_BLOCK):
            seqs = owners[b:b + SCORE_BLOCK]
            top = max(s.score_top for s in seqs)
            logits = self.model.compute_logits(out.hidden[torch.tensor(flat[b:b + SCORE_BLOCK], device=self.device)])
            packed = self.model.sampler.logprobs_of(
                logits, torch.tensor(targets[b:b + SCORE_BLOCK], device=self.device), top).to_host()
            tokens, lps = packed[:, 0].long().tolist(), packed[:, 1].float().tolist()
            top_ids, top_lps = packed[:, 2:2 + top].long().tolist(), packed[:, 2 + top:].float().tolist()
            for i, seq in enumerate(seqs):
                entry = dict(zip(top_ids[i][:seq.score_top], top_lps[i][:seq.score_top]))
                entry[tokens[i]] = lps[i]
                scores.append((seq, lps[i], entry))
        return scores


def mtp_graph_spec(spec: GraphRunnerSpec) -> GraphRunnerSpec:
    """The MTP head's graph runner: uniform steps (catch-up after a verify, chain steps) and,
    where the main model replays a prompt piece alone (``mixed_decode_rows`` off: MTP's lone
    prompt graphs), the head's catch-up over that piece at the same sizes, so a prompt's step
    launches no eager head (an eager head's launches outlasted the graphed piece:
    dev/benchmarks-history.md)."""
    return attrs.evolve(spec, name="mtp", prompt_chunk=0 if spec.mixed_decode_rows else spec.prompt_chunk,
                        mixed_decode_rows=False)


def rows_of(seqs: list[Sequence], packed: torch.Tensor, n: int = 0) -> list[Sampled]:
    """Per row of a host ``packed`` sample tensor [R, 2 + 2n] (token, logprob, top-N ids, top-N
    logprobs): (token, logprob, top-N dict or None) as ``Sequence.append`` takes them."""
    tokens, lps = packed[:, 0].long().tolist(), packed[:, 1].float().tolist()
    top_ids, top_lps = packed[:, 2:2 + n].long().tolist(), packed[:, 2 + n:].float().tolist()
    out = []
    for i, seq in enumerate(seqs):
        top = None
        if seq.params.logprobs is not None:
            k = seq.params.logprobs
            # a masked distribution (masked_logprobs) may have fewer than k tokens: the others are -inf
            top = {t: lp for t, lp in zip(top_ids[i][:k], top_lps[i][:k]) if lp != float("-inf")}
            top[tokens[i]] = lps[i]
        out.append((tokens[i], lps[i], top))
    return out
