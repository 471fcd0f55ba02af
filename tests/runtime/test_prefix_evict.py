"""The prefix cache's eviction: least recently used leaf first, parents after their last child,
pages a sequence holds kept, and a cost that grows with the pages freed, not the pages cached."""

from __future__ import annotations

from types import SimpleNamespace

from bi_core.runtime.cache import BlockAllocator
from bi_core.runtime.prefix_cache import PrefixCache

BS = 4


class CountingRefs(list):
    """The allocator's reference counts, counting how often eviction reads one."""

    reads = 0

    def __getitem__(self, i):
        CountingRefs.reads += 1
        return super().__getitem__(i)


def cache_with(num_blocks: int) -> PrefixCache:
    blocks = BlockAllocator(num_blocks)
    manager = SimpleNamespace(block_size=BS, blocks=blocks, copy_states=lambda src, dst: None)
    return PrefixCache(manager, grid=BS, snapshot_slots=[])


def cached_chain(pc: PrefixCache, tokens: list[int]) -> SimpleNamespace:
    """A sequence whose prompt ``tokens`` computed and cached, then released (only the cache holds
    its pages)."""
    seq = SimpleNamespace(all_ids=tokens, cache_ids=tokens, blocks=pc.cache.blocks.allocate(len(tokens) // BS),
                          prefix_node=None, prefix_end=0, lora_uid=0)
    pc.insert(seq, len(tokens), state_slot=0)
    return seq


def pages_of(pc: PrefixCache) -> set[int]:
    return {n.page for n in pc.nodes.values()}


def test_least_recently_used_leaf_first_and_parents_after_children():
    pc = cache_with(64)
    a = cached_chain(pc, list(range(12)))  # pages a0 a1 a2
    b = cached_chain(pc, list(range(100, 108)))  # b0 b1
    for s in (a, b):
        pc.cache.blocks.release(s.blocks)
    assert pc.evict(1) == 1 and pages_of(pc) == set(a.blocks[:2] + b.blocks)  # a's leaf: a is older
    assert pc.evict(2) == 2 and pages_of(pc) == set(b.blocks)  # then a's parents, leaf first
    assert pc.evict(5) == 2 and not pc.nodes and pc.cache.blocks.num_free == 64


def test_a_match_makes_a_chain_recent_and_pages_in_use_stay():
    pc = cache_with(64)
    a = cached_chain(pc, list(range(8)))
    b = cached_chain(pc, list(range(100, 108)))
    pc.cache.blocks.release(a.blocks)  # b's sequence still holds its pages
    assert pc.evict(4) == 2 and pages_of(pc) == set(b.blocks)
    pc.cache.blocks.release(b.blocks)
    c = cached_chain(pc, list(range(200, 208)))
    pc.cache.blocks.release(c.blocks)
    for node in [pc.nodes[k] for k in list(pc.nodes) if pc.nodes[k].page in b.blocks]:
        pc._touch(node)  # as a match does: b is now the most recent
    assert pc.evict(2) == 2 and pages_of(pc) == set(b.blocks)


def test_an_eviction_reads_as_many_pages_as_it_frees_not_every_cached_page():
    pc = cache_with(1024)
    pc.cache.blocks.refs = CountingRefs(pc.cache.blocks.refs)
    seqs = [cached_chain(pc, [i * 10 + t for t in range(BS)]) for i in range(600)]  # 600 one-page prefixes
    for s in seqs[8:]:
        pc.cache.blocks.release(s.blocks)  # the 8 oldest stay in use
    CountingRefs.reads = 0
    for _ in range(20):
        assert pc.evict(1) == 1
    # each call steps over the 8 leaves in use, then frees one page (about 4 reads of its count);
    # a scan of every cached leaf read about 600 counts a call
    assert CountingRefs.reads <= 20 * 16
    assert {p for s in seqs[:8] for p in s.blocks} <= pages_of(pc) and len(pc.nodes) == 580
