"""Prefix caching: KV pages of prompt chunks, found again by their tokens, with GDN state snapshots.

Exact by construction. A page is cached only if a chunked prefill step on the fixed chunk grid
(multiples of ``prefill_chunk_size`` from position 0, the chunks every prompt is cut into)
computed it, and a GDN snapshot is taken only at the end of such a step. A request that finds its
first ``b`` tokens cached (``b`` a grid point with a snapshot) starts at ``b`` with those pages
and that state, and runs the same chunks from ``b`` on that a cold prefill would run: on an
invariant backend every bit is what the cold prefill computes.

Pages form a trie: a node is one page, keyed by (parent node, the page's tokens); the chain of
keys from the root is the whole token prefix, so a match never rests on a hash. Nodes hold one
reference to their page (the allocator counts references); a node is evicted, least recently
used first and leaves before their parents, only when no sequence holds its page. Snapshots live
in a fixed pool of extra GDN state slots (``cache.prefix_snapshots``), the least recently used
given up first.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import count

import attrs

from bi_core.runtime.sequence import Sequence


@attrs.define(eq=False)
class Node:
    page: int
    parent: Node | None
    key: tuple
    end: int  # tokens of the prefix this page ends
    children: int = 0
    snapshot: int | None = None  # a state slot holding the GDN state after ``end`` tokens
    tick: int = 0  # when a match or an insertion last used it (a clock of the cache's own)


@attrs.define
class Match:
    nodes: list[Node]  # the pages of the hit, in order
    snapshot: int  # state slot to restore

    @property
    def tokens(self) -> int:
        return self.nodes[-1].end


class PrefixCache:
    def __init__(self, cache, *, grid: int, snapshot_slots: list[int]) -> None:
        self.cache = cache  # the CacheManager: page allocator and state copies
        self.block_size = cache.block_size
        self.grid = grid  # snapshots only at multiples of this (the chunk size)
        self.nodes: dict[tuple, Node] = {}
        # eviction candidates: (tick, node) for every leaf, least recently used first; entries go
        # stale (the node used again, given a child, or removed) and are skipped when popped, so an
        # eviction costs O(pages freed + leaves in use), not a scan of every cached page (a scan
        # grew with the cache until it held up graphed steps on the host: dev/benchmarks-history.md)
        self._clock = count(1)
        self._pushes = count()  # ties between two entries of one node never compare the nodes
        self._leaves: list[tuple[int, int, Node]] = []
        self.free_snapshots = list(reversed(snapshot_slots))
        self.snapshots: OrderedDict[int, Node] = OrderedDict()  # snapshot slot -> node, LRU first
        self.queries = self.hits = self.hit_tokens = self.evicted = 0

    # ------------------------------------------------------------------ lookup

    def match(self, seq: Sequence, limit: int) -> Match | None:
        """The longest cached prefix of ``seq`` of at most ``limit`` tokens that ends at a snapshot
        (counted by ``record`` once the sequence is admitted: a match may be retried)."""
        ids, bs = seq.cache_ids, self.block_size
        path, best, parent = [], None, None
        for start in range(0, limit - limit % bs, bs):
            node = self.nodes.get((_parent_key(parent, seq), tuple(ids[start:start + bs])))
            if node is None:
                break
            path.append(node)
            if node.snapshot is not None:
                best = len(path)
            parent = node
        if best is None:
            return None
        for node in path[:best]:
            self._touch(node)
        self.snapshots.move_to_end(path[best - 1].snapshot)
        return Match(path[:best], path[best - 1].snapshot)

    def record(self, hit: Match | None) -> None:
        """Count an admitted sequence's lookup."""
        self.queries += 1
        if hit is not None:
            self.hits += 1
            self.hit_tokens += hit.tokens

    # ------------------------------------------------------------------ insertion

    def cacheable(self, start: int, end: int) -> bool:
        """Whether a chunked prefill step over ``[start, end)`` computed what a cold prefill computes
        at those positions: it starts and ends on the grid."""
        return start % self.grid == 0 and end % self.grid == 0 and end > start

    def insert(self, seq: Sequence, end: int, state_slot: int) -> None:
        """Cache the pages of ``seq`` up to ``end`` (past those already cached for it) and the GDN
        state after ``end`` tokens, held in ``state_slot``. Call right after the step that
        computed them, while the state slot still holds that state."""
        ids, bs = seq.cache_ids, self.block_size
        parent = seq.prefix_node
        for start in range(seq.prefix_end, end, bs):
            key = (_parent_key(parent, seq), tuple(ids[start:start + bs]))
            node = self.nodes.get(key)
            if node is None:  # else someone cached the same tokens already: follow theirs
                node = Node(seq.blocks[start // bs], parent, key, start + bs)
                self.cache.blocks.hold(node.page)
                self.nodes[key] = node
                if parent is not None:
                    parent.children += 1
            self._touch(node)
            parent = node
        seq.prefix_node, seq.prefix_end = parent, end
        if parent is not None and parent.snapshot is None:
            slot = self._snapshot_slot()
            if slot is not None:
                self.cache.copy_states([state_slot], [slot])
                parent.snapshot = slot
                self.snapshots[slot] = parent

    def _snapshot_slot(self) -> int | None:
        if self.free_snapshots:
            return self.free_snapshots.pop()
        if not self.snapshots:
            return None
        slot, node = self.snapshots.popitem(last=False)
        node.snapshot = None
        return slot

    # ------------------------------------------------------------------ eviction

    def _touch(self, node: Node) -> None:
        node.tick = next(self._clock)
        if node.children == 0:
            heapq.heappush(self._leaves, (node.tick, next(self._pushes), node))
        if len(self._leaves) > 2 * len(self.nodes) + 64:  # drop the stale entries
            self._leaves = [(n.tick, next(self._pushes), n) for n in self.nodes.values() if n.children == 0]
            heapq.heapify(self._leaves)

    def evict(self, pages: int) -> int:
        """Free up to ``pages`` pages that only the cache holds, least recently used leaf first (a
        parent becomes a leaf when its last child goes); returns how many."""
        freed, busy = 0, []
        while freed < pages and self._leaves:
            entry = heapq.heappop(self._leaves)
            tick, _, node = entry
            if node.tick != tick or node.children or self.nodes.get(node.key) is not node:
                continue  # stale: used again since, given a child, or already removed
            if self.cache.blocks.refs[node.page] != 1:
                busy.append(entry)  # a sequence holds its page: a candidate again later
                continue
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not None and parent.children == 0:
                heapq.heappush(self._leaves, (parent.tick, next(self._pushes), parent))
        for entry in busy:
            heapq.heappush(self._leaves, entry)
        self.evicted += freed
        return freed

    def _remove(self, node: Node) -> None:
        del self.nodes[node.key]
        if node.parent is not None:
            node.parent.children -= 1
        if node.snapshot is not None:
            del self.snapshots[node.snapshot]
            self.free_snapshots.append(node.snapshot)
        self.cache.blocks.drop(node.page)

    def clear(self, *, reset_stats: bool = False) -> None:
        """Drop everything (new weights): pages no sequence holds are free again."""
        if reset_stats:
            self.queries = self.hits = self.hit_tokens = self.evicted = 0
        for node in self.nodes.values():
            self.cache.blocks.drop(node.page)
            if node.snapshot is not None:
                self.free_snapshots.append(node.snapshot)
        self.nodes.clear()
        self._leaves.clear()
        self.snapshots.clear()

    def stats(self) -> dict[str, int]:
        return {"queries": self.queries, "hits": self.hits, "hit_tokens": self.hit_tokens,
                "cached_pages": len(self.nodes), "snapshots": len(self.snapshots), "evicted_pages": self.evicted}


def _parent_key(parent: Node | None, seq: Sequence) -> object:
    """A node's parent in its key; a first page's is the request's adapter version (``lora_uid``,
    0: none), so no request reuses pages computed with another adapter or another version of it."""
    return id(parent) if parent is not None else ("root", seq.lora_uid)
