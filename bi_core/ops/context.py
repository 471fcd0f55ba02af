"""The one explicit forward context: everything a step's kernels need to know about the batch.

Tensors live on the model's device (integer tensors are int64); ``*_host`` lists are the same
facts on the host for eager paths (the reference backend loops over sequences). Built by the
runtime for every step (``runtime/batch.py``), or views of a CUDA graph's static buffers.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class GraphShape:
    """The step a CUDA graph runs: ``bucket`` recurrent sequences (padding included) of ``q_len``
    tokens each, then, when ``chunk`` > 0 (a mixed step), one prompt sequence of ``chunk`` rows
    in the chunked form (a shorter piece padded at its end: ``ForwardContext.valid_tokens``)."""

    q_len: int
    bucket: int
    chunk: int = 0

    @property
    def key(self) -> tuple[int, ...]:
        return (self.q_len, self.bucket) if not self.chunk else (self.q_len, self.bucket, self.chunk)

    def spans(self, num_seqs: int, tail: int | None = None) -> list[tuple[int, int]]:
        """Where the tokens of a step of ``num_seqs`` real sequences lie among the graph's rows, in
        order: padding sequences follow the real recurrent ones (before the prompt chunk), and a
        prompt piece of ``tail`` < ``chunk`` tokens (a prompt's last) is padded at its end."""
        if not self.chunk:
            return [(0, num_seqs * self.q_len)]
        decode = (num_seqs - 1) * self.q_len
        start, n = self.bucket * self.q_len, self.chunk if tail is None else tail
        return [(0, decode), (start, start + n)] if decode else [(start, start + n)]


@attrs.define
class ForwardContext:
    """A flat (ragged) batch: the tokens of B sequences laid end to end, T tokens in all."""

    # [T] int64, each token's rotary position: its index in its sequence, plus the request's M-RoPE
    # delta past an image prompt's vision tokens (runtime/batch.py); KV slots never derive from it
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B+1] token offsets of each sequence in the flat batch
    context_lens: torch.Tensor  # [B] KV length after this step (past + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] KV pages of each sequence (-1 = none)
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot (page * block_size + offset) of each token
    state_slots: torch.Tensor  # [B] int64, GDN state slot each sequence reads (its state before this step)
    logits_indices: torch.Tensor  # [R] rows whose logits the step returns
    query_lens_host: list[int]
    cu_seqlens_host: list[int]  # the same offsets as cu_seqlens_q, on the host
    # None where only the device knows them (an MTP draft chain moved by a device-side accept
    # count: ``CudaGraphRunner.shift``; only impls that read lengths on the device run then)
    context_lens_host: list[int] | None
    state_slots_host: list[int]
    token_state_slots: torch.Tensor  # [T] int64, GDN state slot that receives the state after each token
    token_state_slots_host: list[int]
    state_ring: int  # state slots per sequence (1 + speculative tokens); > 1: store the state after every token
    is_recurrent_host: list[bool]  # GDN: recurrent (one-token) form for this sequence, else chunked
    recurrent_ids: torch.Tensor  # [B_rec] indices of the sequences with is_recurrent_host
    block_tables_host: list[list[int]]
    block_size: int
    logits_indices_host: list[int] = attrs.field(factory=list)
    logits_all_rows: bool = False  # logits_indices is every row (a graph's static batch): no gather
    sample_keys: torch.Tensor | None = None  # [R] int64 per logits row: mix_seed(request seed, position)
    temperatures: torch.Tensor | None = None  # [R] float64 per logits row (0 = greedy)
    graph: GraphShape | None = None  # set when the step runs as (or is captured into) a CUDA graph
    # [B] real tokens of each sequence when a graph pads a sequence at its end (a prompt's last
    # chunk in a mixed graph: its rows past these are padding, their KV on the scratch page);
    # None: every row is real
    valid_tokens: torch.Tensor | None = None
    valid_tokens_host: list[int] | None = None
    # per-step plans an op impl computes once and reuses in every layer; each impl reads only the
    # keys it wrote (a graph's static context keeps one dict for all its replays)
    op_plans: dict = attrs.field(factory=dict)
    # device tensors an op derives from this context's device tensors inside the forward, once,
    # for every layer (inside a captured graph they are recomputed by every replay, where an
    # op_plans entry would keep the values of the capture); the model's forward empties it first
    step_tensors: dict = attrs.field(factory=dict)
    # [T] int64: the LoRA slot of each row's adapter (-1 = none), when the engine serves adapters
    lora_slots: torch.Tensor | None = None
    # M-RoPE (a step with images): [T, rotary_dim / 2] int64, the position each rotary frequency of
    # each token reads (runtime/multimodal.py); None: ``positions`` for every frequency (text only)
    rope_positions: torch.Tensor | None = None
    # vision embeddings: rows ``embed_rows`` [E] of the token embeddings replaced by ``embeds`` [E, H]
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def past_len(self, i: int) -> int:
        return self.context_lens_host[i] - self.query_lens_host[i]

    def token_range(self, i: int) -> tuple[int, int]:
        return self.cu_seqlens_host[i], self.cu_seqlens_host[i + 1]

    def real_range(self, i: int) -> tuple[int, int]:
        """``token_range`` without the padding rows at its end (``valid_tokens``)."""
        a, b = self.token_range(i)
        return (a, a + self.valid_tokens_host[i]) if self.valid_tokens_host is not None else (a, b)


@attrs.define
class HostBatch:
    """One step's batch on the host: B sequences, T tokens laid end to end."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T] flat KV slot (page * block_size + offset)
    token_state_slots: list[int]  # [T] GDN state slot receiving the state after each token
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B] KV length after this step
    state_slots: list[int]  # [B] GDN state slot each sequence reads
    blocks: list[list[int]]  # [B] KV pages of each sequence
    is_recurrent: list[bool]  # [B] GDN recurrent (decode/verify) form, else chunked
    logits_rows: list[int]  # flat rows whose logits the step returns
    block_size: int
    ring: int
    sample_keys: list[int] = attrs.field(factory=list)  # per logits row, when the step samples on the device
    temperatures: list[float] = attrs.field(factory=list)
    valid_tokens: list[int] | None = None  # [B] real tokens per sequence, when a graph pads one (else all)
    lora_slots: list[int] = attrs.field(factory=list)  # [T] LoRA slot per row (-1 none), when adapters are served
    # a step with images (runtime/multimodal.py): per token, the position each rotary frequency
    # reads ([T][rotary_dim / 2]); and the rows whose embeddings the vision tower gives, with them
    rope_positions: list[list[int]] | None = None
    embed_rows: list[int] = attrs.field(factory=list)
    embeds: list[torch.Tensor] = attrs.field(factory=list)
    mrope_axes: list[int] = attrs.field(factory=list)

    @property
    def is_multimodal(self) -> bool:
        return self.rope_positions is not None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for q in self.query_lens:
            cu.append(cu[-1] + q)
        return cu


@attrs.define
class ModelCaches:
    """Cache tensors a forward reads and writes; owned by the runtime, indexed by layer kind."""

    k: list[torch.Tensor]  # per attention layer: [num_blocks, block_size, Hkv, D]
    v: list[torch.Tensor]
    conv: list[torch.Tensor]  # per GDN layer: [num_slots, conv_dim, Kc - 1]
    recurrent: list[torch.Tensor]  # per GDN layer: [num_slots, Hv, Dv, Dk] float32 (S transposed)
