"""KV pages for full-attention layers and per-sequence state slots for GDN layers."""

from __future__ import annotations

import math

import torch

from bi_core.config import CacheConfig
from bi_core.errors import ConfigError
from bi_core.models.args import ModelArgs
from bi_core.ops.attention import kv_cache_torch_dtype
from bi_core.ops.context import ModelCaches
from bi_core.runtime import gc_heap

CPU_AUTO_BUDGET = 1 << 30  # bytes of KV pages when num_blocks is auto on the CPU


class BlockAllocator:
    """Pages with reference counts: a page shared by several sequences (the prompt of n samples)
    returns to the free list when its last holder releases it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.held = [False] * num_blocks  # the prefix cache holds a reference
        self.num_idle = 0  # pages only the prefix cache holds (free for the taking)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), "caller checks num_free first"
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        for b in blocks:
            assert self.refs[b] > 0, "only pages in use are shared"
            self.num_idle -= self.held[b] and self.refs[b] == 1
            self.refs[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            self.num_idle += self.held[b] and self.refs[b] == 1
            if self.refs[b] == 0:
                self.free.append(b)

    def hold(self, block: int) -> None:
        """The prefix cache's reference to a page a sequence computed."""
        self.share([block])
        self.held[block] = True

    def drop(self, block: int) -> None:
        self.held[block] = False
        self.num_idle -= self.refs[block] == 1
        self.release([block])


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        self.free.append(slot)


class CacheManager:
    """Owns the cache tensors (main model and MTP head) and hands out pages and slots."""

    def __init__(self, args: ModelArgs, config: CacheConfig, *, num_slots: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, with_mtp: bool, state_ring: int = 1,
                 num_snapshots: int = 0) -> None:
        self.block_size = config.block_size
        self.device = device
        num_attn = len(args.full_attention_layers) + (1 if with_mtp else 0)
        kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)  # as the attention specs have it
        page_bytes = 2 * self.block_size * args.num_key_value_heads * args.head_dim * kv_dtype.itemsize * num_attn
        state_dtype = getattr(torch, config.ssm_state_dtype)
        num_gdn = len(args.gdn_layers)
        per_slot = num_gdn * (args.conv_dim * (args.linear_conv_kernel_dim - 1) * dtype.itemsize +
                              args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim *
                              state_dtype.itemsize)
        self.state_slot_bytes = per_slot
        state_bytes = per_slot * (num_slots * state_ring + 1 + num_snapshots)
        memory = _device_memory(device) if device.type == "cuda" else None  # (free, total) bytes
        self._check_state_memory(state_bytes, num_slots, state_ring, config, memory)
        if config.num_blocks == "auto":
            self.num_blocks = self._auto_blocks(page_bytes, num_slots, max_model_len, config, memory, state_bytes)
        else:
            self.num_blocks = config.num_blocks
        # One extra page and one extra state slot are reserved for padding rows (CUDA-graph buckets).
        # GDN state: each sequence slot owns ``state_ring`` consecutive slots (speculative decoding).
        self.state_ring = state_ring
        # Prefix-cache snapshots of GDN states follow, in slots of their own.
        self.scratch_page, self.scratch_slot = self.num_blocks, num_slots * state_ring
        num_states = num_slots * state_ring + 1 + num_snapshots
        self.snapshot_slots = list(range(num_slots * state_ring + 1, num_states))
        kv_shape = (self.num_blocks + 1, self.block_size, args.num_key_value_heads, args.head_dim)
        # zeroed: reads past a sequence's written keys (a padded prompt piece's padding rows, masked
        # key blocks) see finite values, never NaN garbage (0 * NaN would reach a real row)
        kv = [torch.zeros(kv_shape, dtype=kv_dtype, device=device) for _ in range(2 * num_attn)]
        conv = [torch.zeros(num_states, args.conv_dim, args.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                for _ in range(num_gdn)]
        # the state is stored transposed, [Hv, Dv, Dk] (Dk contiguous): the recurrent kernel's
        # per-token reductions over Dk then stay inside a warp
        rec_shape = (num_states, args.linear_num_value_heads, args.linear_value_head_dim, args.linear_key_head_dim)
        rec = [torch.zeros(rec_shape, dtype=state_dtype, device=device) for _ in range(num_gdn)]
        n_main = len(args.full_attention_layers)
        self.main = ModelCaches(k=kv[0:n_main], v=kv[n_main:2 * n_main], conv=conv, recurrent=rec)
        self.mtp = ModelCaches(k=[kv[2 * n_main]], v=[kv[2 * n_main + 1]], conv=[], recurrent=[]) if with_mtp else None
        self.blocks = BlockAllocator(self.num_blocks)
        self.slots = SlotAllocator(num_slots)
        self.num_slots = num_slots
        self.prefix = None  # a PrefixCache when cache.prefix_caching is on (set by the engine)

    def reclaim(self, pages: int) -> bool:
        """Whether ``pages`` pages are free, after evicting cached prefixes no one uses if needed."""
        short = pages - self.blocks.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return pages <= self.blocks.num_free

    @property
    def num_pages_in_use(self) -> int:
        """Pages sequences hold (cached prefixes no sequence holds count as free)."""
        return self.num_blocks - self.blocks.num_free - self.blocks.num_idle

    @staticmethod
    def _check_state_memory(state_bytes: int, num_slots: int, ring: int, config: CacheConfig,
                            memory: tuple[int, int] | None) -> None:
        if memory is None:
            return
        free, total = memory
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        if state_bytes > budget:
            raise ConfigError("scheduler.max_num_seqs", f"the GDN states of {num_slots} sequences (x{ring} slots "
                              f"each) need {state_bytes / 2**30:.1f} GiB but {max(budget, 0) / 2**30:.1f} GiB are left "
                              "after the weights (cache.gpu_memory_utilization); lower scheduler.max_num_seqs, "
                              "or use cache.ssm_state_dtype: bfloat16")

    def _auto_blocks(self, page_bytes: int, num_slots: int, max_model_len: int, config: CacheConfig,
                     memory: tuple[int, int] | None, state_bytes: int) -> int:
        wanted = num_slots * math.ceil(max_model_len / self.block_size)
        if memory is not None:
            free, total = memory
            used = total - free
            budget = int(total * config.gpu_memory_utilization) - used - state_bytes
        else:
            budget = CPU_AUTO_BUDGET
        affordable = budget // page_bytes
        if affordable < 1:
            raise ConfigError("cache.num_blocks", f"no memory left for KV pages (budget {budget} bytes); lower "
                              "scheduler.max_num_seqs or raise cache.gpu_memory_utilization")
        return int(max(1, min(wanted, affordable)))

    def state_at(self, slot: int, num_tokens: int) -> int:
        """The state slot holding sequence slot ``slot``'s GDN state after ``num_tokens`` tokens
        (its ring, as ``runtime/batch.py`` addresses it)."""
        return slot * self.state_ring + num_tokens % self.state_ring

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """KV of pages ``src`` into pages ``dst`` (main model and MTP head)."""
        if not src:
            return
        s, d = self._index(src), self._index(dst)
        for caches in filter(None, (self.main, self.mtp)):
            for t in (*caches.k, *caches.v):
                t = t.view(torch.uint8) if t.element_size() == 1 else t  # FP8 pages: the same bytes
                t[d] = t[s]

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """GDN conv and recurrent states of state slots ``src`` into slots ``dst`` (ring slots)."""
        if not src:
            return
        s, d = self._index(src), self._index(dst)
        for t in (*self.main.conv, *self.main.recurrent):
            t[d] = t[s]

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor (KV pages, GDN conv and recurrent states; main model and MTP head)."""
        return [t for caches in filter(None, (self.main, self.mtp))
                for t in (*caches.k, *caches.v, *caches.conv, *caches.recurrent)]

    def release(self) -> None:
        """Free the cache memory (sleep): every tensor keeps its shape, its storage goes; nothing
        may hold pages (the prefix cache is cleared first)."""
        assert self.num_pages_in_use == 0 and self.slots.num_free == self.num_slots, "release with pages in use"
        if self.prefix is not None:
            self.prefix.clear()
        for t in self.tensors():
            t.untyped_storage().resize_(0)

    def restore(self) -> None:
        """Allocate the cache memory again (wake): states zeroed, as at start."""
        for t in self.tensors():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.zero_()

    @property
    def released(self) -> bool:
        return any(t.untyped_storage().size() == 0 and t.numel() for t in self.tensors())

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) device bytes, counting what this process no longer uses as free: engines
    dropped earlier (collected now, their reference cycles included) and the caching allocator's
    idle blocks (handed back to the driver first). A second engine in one process (tests, an
    evaluation loop) sizes its caches from what is really left."""
    gc_heap.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)
