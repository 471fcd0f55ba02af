"""How a model step is launched: the spec of a graph runner and the protocol every runner keeps
(``eager.py``: eager launches; ``cuda.py``: CUDA graphs per batch bucket, or the same static
buffers rerun without capture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from bi_core.ops.context import ForwardContext, HostBatch

StepFn = Callable[..., tuple[torch.Tensor, ...]]


@attrs.frozen(kw_only=True)
class GraphRunnerSpec:
    """One forward's graph runner: whether its steps replay graphs, and the shapes they are
    captured at (``runtime/graphs/mode.py`` resolves it from ``graph.*``)."""

    dtype: torch.dtype
    device: torch.device
    name: str = "model"  # which forward it runs ("model", "mtp"): each gets its own runner and graphs
    use_graphs: bool
    # with use_graphs: capture CUDA graphs (a CUDA device), or rerun each graph step on the same
    # static buffers without capturing (``graph.capture: false``; any device): the bucketing,
    # padding and static contexts of graph steps, with host lists the reference backend reads
    capture: bool = True
    max_batch_size: int
    max_blocks_per_seq: int = 0
    scratch_page: int = 0  # KV page that padding rows write to (never given to a sequence)
    scratch_slot: int = 0  # GDN state slot of padding rows (never given to a sequence)
    state_ring: int = 1  # GDN state slots per sequence
    query_lens: tuple[int, ...] = (1,)  # tokens per sequence of the uniform steps worth capturing
    # > 0: also capture mixed steps, one-token decode rows plus one prompt piece of at most this
    # many tokens (the scheduler's chunk size; a shorter last piece is padded); 0: steps with
    # prompt rows run eagerly
    prompt_chunk: int = 0
    # with prompt_chunk > 0: mixed steps may hold decode rows (one-token decode strategies, AR);
    # False: only a prompt piece alone (bucket 0) replays a graph (a strategy whose decode rows
    # are several tokens, MTP: its prompts' steps still leave the host's eager launches)
    mixed_decode_rows: bool = True
    lora: bool = False  # the model serves adapters: the static buffers carry each row's LoRA slot


class GraphRunner(Protocol):
    """What the model runner calls to launch a step (``EagerRunner``, ``CudaGraphRunner``)."""

    def make_context(self, batch: HostBatch, device: torch.device) -> tuple[torch.Tensor, ForwardContext]:
        """The step's input ids and context on the device (a graph runner packs a step it will
        replay straight into that graph's static buffers)."""

    def capture_all(self, step: StepFn, block_size: int, prepare: Callable[[ForwardContext], None] | None = None,
                    extra: torch.Tensor | None = None) -> int:
        """Capture every graph this runner would capture on first use, now (at engine start);
        returns how many (an eager runner: 0)."""

    def run(self, step: StepFn, input_ids: torch.Tensor, ctx: ForwardContext,
            prepare: Callable[[ForwardContext], None] | None = None,
            extra: torch.Tensor | None = None, ids_from: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Run ``step(input_ids, ctx)`` (or ``step(input_ids, ctx, extra)`` with a per-token input
        such as the MTP head's hidden states). The step returns a tuple: a per-token output, then
        outputs with one row per ``ctx.logits_indices`` row; so does ``run``. ``prepare(ctx)`` does
        host-side per-step planning and always runs outside any captured graph. ``ids_from``: an
        input id staged as ``-1 - i`` is replaced by token i of it on the device first
        (``runtime.batch.gather_ids``)."""

    # Optional: ``advance(ctx) -> ForwardContext | None``, the next one-token step of the same
    # sequences on the device, without host packing; ``shift``, ``program`` (``cuda.py``)

    def wait_inputs(self) -> None:
        """Block until the inputs of the last step launched have left the host (its staging
        buffers and any host-side plan's): call before planning a step while one still runs."""

    def release(self) -> None:
        """Forget every captured graph and its static buffers (their device memory goes); the
        next uniform step captures again. Before the weights or caches move (sleep): a graph
        replays the addresses it was captured with."""
