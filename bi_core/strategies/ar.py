"""Autoregressive decoding: one forward over the scheduled tokens, one sample per finished row.

Overlap (``graph.overlap``, on by default). A decode step replayed from a CUDA graph, every row
sampled on the device, does not hold the host until its tokens are known. Its samples are copied
to pinned host memory behind it; meanwhile the host plans the next decode step
(``Scheduler.plan_decode``: the same sequences one token on, less those this step ends by length),
stages it with each row's *source row* in place of its token id, and launches it: the graph
runner turns the source rows into this step's sampled tokens on the device
(``runtime.batch.gather_ids``) before the replay. Only then does the host wait for this step's
samples and append them. So up to two steps are queued and the device never waits for the
host's planning and bookkeeping (~1.5 ms a step at 256 sequences, benchmarks section 13).

What stays true: the next step is exactly what ``schedule`` would return after this step
(``plan_decode`` refuses otherwise: requests waiting, pages short, ...), except that a sequence
this step ends with a stop token still runs one wasted row in it; that row's output is dropped,
and its pages and state slot, released when this step is booked, are reused only by work queued
after it. Requests added between steps are admitted one step later. Every row computes what it
would alone, so outputs are the same bits with or without overlap (tests/strategies)."""

from __future__ import annotations

import attrs
import torch

from bi_core.hookspecs import hookimpl
from bi_core.ops.sampling import device_sampled
from bi_core.runtime.scheduler import Scheduled
from bi_core.runtime.sequence import Status
from bi_core.strategies.base import Strategy


@attrs.define
class _Flight:
    """A launched decode step whose samples are on their way to the host."""

    scheduled: list[Scheduled]  # its rows, in order
    samples: torch.Tensor  # [rows, 2] float64 (token, logprob) on the device (the graph's static output)
    host: torch.Tensor  # their host copy (pinned on CUDA), valid once ``ready`` has fired
    ready: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


class ARStrategy(Strategy):
    name = "ar"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.overlap = engine.config.graph.overlap
        self._flight: _Flight | None = None  # a step launched ahead, not yet booked
        self._landing: list[torch.Tensor] = []  # two host buffers for samples in flight, used in turn
        self._turn = 0
        self.num_ahead = 0  # steps launched ahead so far

    def launched(self) -> list[Scheduled] | None:
        f = self._flight
        live = [s for s in f.scheduled if s.seq.status is Status.RUNNING] if f is not None else []
        if not live:  # every row's request ended (stop token, abort): nothing left to book
            self._flight = None
            return None
        return live

    def step(self, scheduled: list[Scheduled]) -> None:
        flight, self._flight = self._flight, None
        if flight is None:
            flight = self._run(scheduled)
            if flight is None:
                return
        if self.overlap:
            self._flight = self._launch_next(flight)
        packed = flight.wait()
        eng = self.engine
        live = [(i, s.seq) for i, s in enumerate(flight.scheduled) if s.seq.status is Status.RUNNING]
        rows = eng.rows_of([seq for _, seq in live], packed[[i for i, _ in live]])
        for (_, seq), (token, lp, top) in zip(live, rows):
            seq.append(token, lp, top, eng.eos_ids)

    def _run(self, scheduled: list[Scheduled]) -> _Flight | None:
        """Plan and run a scheduled step. A decode step whose samples can land asynchronously (a
        graph replay, every row sampled on the device) is returned in flight; any other is
        booked here."""
        eng = self.engine
        seqs = [s.seq for s in scheduled]
        samples = [s.samples for s in scheduled]
        input_ids, ctx = eng.make_batch(
            [seq.ids(seq.num_computed, seq.num_computed + s.num_tokens) for seq, s in zip(seqs, scheduled)],
            seqs,
            [s.recurrent for s in scheduled],
            [[s.num_tokens - 1] if sample else [] for s, sample in zip(scheduled, samples)],
            sample_positions=[[seq.num_tokens] if sample else [] for seq, sample in zip(seqs, samples)])
        out = eng.run_model(input_ids, ctx)
        eng.record_scores(scheduled, out.hidden, ctx.cu_seqlens_host)
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        if all(samples) and self._flies(seqs, ctx, out.samples):
            return self._land(scheduled, out.samples)
        sampling = [seq for seq, sample in zip(seqs, samples) if sample]
        if sampling:
            eng.sample_and_append(sampling, out)
        return None

    def _flies(self, seqs: list, ctx, samples: torch.Tensor | None) -> bool:
        """Whether the samples of a step that samples every row are all its booking needs: a graph
        replay (uniform one-token rows) sampled on the device, for requests that want nothing more
        (no filtering, top-N logprobs, n-sample fork or logits hook)."""
        return (samples is not None and ctx.extras.get("graph_key") is not None and self.engine.on_logits is None
                and not any(seq.followers for seq in seqs) and device_sampled(seqs))

    def _land(self, scheduled: list[Scheduled], samples: torch.Tensor) -> _Flight:
        """Queue the copy of a launched step's samples to the host, behind the step."""
        if not self._landing:
            size = (self.engine.runner_spec.max_batch_size, 2)
            pinned = samples.is_cuda
            self._landing = [torch.empty(size, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        host = self._landing[self._turn][: samples.shape[0]]
        self._turn ^= 1
        host.copy_(samples, non_blocking=True)
        ready = None
        if samples.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _Flight(scheduled, samples, host, ready)

    def _launch_next(self, flight: _Flight) -> _Flight | None:
        """Plan, stage and launch the decode step after ``flight`` before its tokens are known."""
        eng = self.engine
        continuing, ending = [], []
        for s in flight.scheduled:
            if s.seq.status is Status.RUNNING:
                (ending if s.seq.at_length(1) else continuing).append(s.seq)
        nxt = eng.scheduler.plan_decode(continuing, ending)
        if nxt is None:
            return None
        row = {id(s.seq): i for i, s in enumerate(flight.scheduled)}
        seqs = [s.seq for s in nxt]
        eng.runner.wait_inputs()  # the running step's staged inputs are on the device: host buffers are free
        # each row's token is the one it samples in the running step, at position num_computed
        input_ids, ctx = eng.make_batch([[row[id(seq)]] for seq in seqs], seqs, [True] * len(seqs), [[0]] * len(seqs),
                                        sample_positions=[[seq.num_computed + 1] for seq in seqs])
        out = eng.run_model(input_ids, ctx, ids_from=flight.samples)
        for seq in seqs:
            seq.num_computed += 1
        self.num_ahead += 1
        return self._land(nxt, out.samples)


@hookimpl
def bi_register_strategies(register) -> None:
    register(ARStrategy)
