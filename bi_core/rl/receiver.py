"""The engine's side of weight sync from a trainer (the protocol: ``bi_core.rl.sync_protocol``).

Each engine rank (tensor parallel: every rank, told by rank 0 through the lock-step) joins the
group, checks an update's metadata against its model, takes part in the handshake, receives the
buckets and copies each into its model as it lands (its own shard of every full tensor, as
``update_weights`` does), then confirms.

Unfinished requests: an update is refused while any request has started (a token computed: its
tokens would mix two models), as ``update_weights`` refuses; RL users pause first, with mode
``abort`` or ``wait`` (a request kept by mode ``keep`` has started, so it blocks an update).
Requests queued but not started (added while paused, or held by mode ``wait``) stay queued and
run wholly on the new weights; their ``weight_version`` becomes the new one.

A failure after some buckets were copied leaves the model part old, part new; a level-2 sleep
leaves no weights at all: either way the engine then refuses new requests (``check_serving``:
``coverage.WeightsMissing``) until updates that rewrite what is missing have landed."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from bi_core.errors import BiEngineError, CheckpointError, RequestError
from bi_core.models.loader import TensorDict, apply_update, check_update
from bi_core.models.vision_weights import apply_vision_update, check_vision_update
from bi_core.parallel import lockstep
from bi_core.rl.coverage import Coverage
from bi_core.rl.joining import Join
from bi_core.rl.sync_protocol import (
    GO,
    REFUSED,
    WeightGroup,
    bucket_layout,
    fingerprint,
    nbytes,
    no_go,
    parse_dtype,
    parse_shape,
    resolve_backend,
    view,
)
from bi_core.runtime.sequence import Sequence, Status

log = logging.getLogger(__name__)
WHAT = "update_weights_from_distributed"


def started(seq: Sequence) -> bool:
    """Whether a request has computed anything (a prompt chunk, a token, a score)."""
    return (seq.status is not Status.WAITING or seq.num_computed > 0 or bool(seq.output_ids)
            or bool(seq.scored_logprobs))


def parse_metadata(names, dtypes, shapes) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
    if not (isinstance(names, Seq) and isinstance(dtypes, Seq) and isinstance(shapes, Seq)) or isinstance(names, str):
        raise RequestError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one of each per tensor")
    if not names:
        raise RequestError("no tensors to update (names is empty)")
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise RequestError(f"names must be strings, got {bad[:3]!r}")
    seen, dup = set(), []
    for n in names:
        if n in seen:
            dup.append(n)
        seen.add(n)
    if dup:
        raise RequestError(f"names repeat: {dup[:5]}")
    return list(names), [parse_dtype(d) for d in dtypes], [parse_shape(s) for s in shapes]


class WeightSync:
    """The weight-update groups this engine rank belongs to, and whether its weights are whole."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.groups: dict[str, WeightGroup] = {}
        self.joining: dict[str, Join] = {}  # groups whose rendezvous runs in a thread (``joining.py``)
        self.coverage = Coverage(engine.model)  # what a level-2 sleep or a broken update left unwritten

    # ------------------------------------------------------------------ serving

    def check_serving(self) -> None:
        """WeightsMissing (a RequestError) while the weights are not whole: a level-2 sleep dropped
        them, or an incomplete update left the model part old, part new."""
        self.coverage.check()

    def landed(self, steps) -> None:
        """A complete update wrote these copy steps (``loader.check_update``'s)."""
        self.coverage.landed(steps)

    def released(self) -> None:
        """A level-2 sleep dropped every weight."""
        self.coverage.lose_all("they were released by sleep level 2 and no weight update has filled them since")

    def _broke(self, err: BiEngineError, applied: list, done: int, total: int) -> None:
        if applied:
            reason = f"a weight update from the trainer failed after {done} of {total} bucket(s) were copied " \
                     f"into the model ({err})"
            self.coverage.lose(applied, reason)
            log.error("%s", reason)

    # ------------------------------------------------------------------ the group

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str | None, timeout_s: float, wait: bool = True) -> Join:
        """Check the call, then join in a thread (``joining.Join``); ``wait``: until it is done (its
        error raised here). Without, the group is usable once the join is done: ``settle`` files
        it, and a call that needs it first waits for it."""
        e = self.engine
        ints = {"master_port": master_port, "rank_offset": rank_offset, "world_size": world_size}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool)]
        if bad or not isinstance(master_address, str) or not isinstance(group_name, str) or not group_name:
            raise RequestError("init_weights_update_group: master_address and group_name must be non-empty "
                               f"strings and {', '.join(ints)} ints")
        if not 0 < master_port < 65536:
            raise RequestError(f"init_weights_update_group: master_port {master_port} is not a TCP port")
        if rank_offset < 1 or rank_offset + e.tp.world > world_size:
            raise RequestError(f"init_weights_update_group: the trainer is rank 0, so this engine's {e.tp.world} "
                               f"rank(s) need rank_offset >= 1 and rank_offset + {e.tp.world} <= world_size; got "
                               f"rank_offset={rank_offset}, world_size={world_size}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise RequestError(f"init_weights_update_group: timeout_s must be a positive number, got {timeout_s!r}")
        if group_name in self.groups or group_name in self.joining:
            state = "exists already" if group_name in self.groups else "is being joined"
            raise RequestError(f"init_weights_update_group: group '{group_name}' {state} "
                               "(destroy_weights_update_group first)")
        backend = resolve_backend(backend, e.device)
        e._mirror(lockstep.InitWeightsUpdateGroup(master_address, master_port, rank_offset, world_size, group_name,
                                                  backend, float(timeout_s)), now=True)
        join = Join(group_name, lambda: WeightGroup(group_name, master_address, master_port, rank_offset + e.tp.rank,
                                                    world_size, backend, e.device, float(timeout_s)), float(timeout_s))
        self.joining[group_name] = join
        if wait:
            self.settle(join)
        return join

    def settle(self, join: Join) -> WeightGroup:
        """Wait for ``join`` (at most its timeout) and file its group; its error is raised (and the
        name is free again). A join destroyed meanwhile is a RequestError."""
        if self.joining.get(join.name) is not join:
            raise RequestError(f"init_weights_update_group: group '{join.name}' was destroyed while it was being "
                               "joined")
        try:
            group = join.wait()
        finally:
            del self.joining[join.name]
        self.groups[join.name] = group
        return group

    def states(self) -> dict[str, dict]:
        """Each group's state (``/health``): ready, or joining (since when, its timeout)."""
        return {**{n: {"state": "ready"} for n in self.groups}, **{n: j.state() for n, j in self.joining.items()}}

    def abandon_joins(self) -> None:
        """Give up every join still running (the engine stops): each group is left once its thread has it."""
        for join in self.joining.values():
            join.abandon()
        self.joining.clear()

    def destroy_group(self, group_name: str) -> None:
        join = self.joining.pop(group_name, None)
        if join is None:
            group = self._group(group_name, "destroy_weights_update_group")
        self.engine._mirror(lockstep.DestroyWeightsUpdateGroup(group_name), now=True)
        if join is not None:  # still joining: given up (left as soon as its thread has it)
            join.abandon()
            return
        del self.groups[group_name]
        group.close()

    def _group(self, group_name: str, what: str) -> WeightGroup:
        if group_name in self.joining:  # a call that needs it waits for the join (at most its timeout)
            return self.settle(self.joining[group_name])
        if group_name not in self.groups:
            raise RequestError(f"{what}: no weight-update group '{group_name}' (init_weights_update_group first; "
                               f"groups now: {sorted(self.groups) or 'none'})")
        return self.groups[group_name]

    # ------------------------------------------------------------------ an update

    def receive(self, names, dtypes, shapes, group_name: str, flush_cache: bool, weight_version: int | None,
                abort_all: bool = False) -> int:
        """One update from the trainer (``protocol`` steps 2-5); returns how many tensors were copied.
        ``abort_all``: abort every unfinished request, once the update has passed its checks (a
        refused update aborts nothing)."""
        e = self.engine
        group = self._group(group_name, WHAT)  # no handshake without the group: the trainer's request fails
        meta, steps, refusal = self._check(names, dtypes, shapes, weight_version, abort_all)
        if refusal is None and abort_all:
            e.abort_all()
        e._mirror(lockstep.UpdateWeightsFromTrainer(names, dtypes, shapes, group_name, flush_cache, weight_version),
                  now=True)
        rows = group.handshake([REFUSED if refusal else GO, 0, fingerprint(*meta) if meta else 0])
        if refusal is not None:
            raise refusal
        why = no_go(rows)
        if why is not None:
            raise RequestError(f"{WHAT}: the handshake said no: {why}; nothing was changed")
        names, dtypes, shapes = meta
        layout = bucket_layout([nbytes(s, d) for s, d in zip(shapes, dtypes)], rows[0][1])
        by_name = {st.name: st for st in steps}
        applied: list = []
        failure = None
        for i, bucket in enumerate(layout):
            buf = torch.empty(bucket.size, dtype=torch.uint8, device=group.device)
            try:
                group.broadcast(buf, f"{WHAT}: receiving bucket {i + 1} of {len(layout)} from the trainer")
            except BiEngineError as err:
                self._broke(err, applied, i, len(layout))
                raise
            if failure is None:
                part = TensorDict([(names[j], view(buf, off, n, shapes[j], dtypes[j])) for j, off, n in bucket.entries])
                mine = [by_name[n] for n in part.names() if n in by_name]
                applied += mine
                try:
                    apply_update(e.model, part, mine)
                    if e.runner.vision is not None:  # (checked with the metadata: this maps the names)
                        apply_vision_update(e.runner.vision, part, check_vision_update(e.runner.vision, part,
                                                                                       in_memory=True))
                except (RuntimeError, BiEngineError) as err:
                    failure = BiEngineError(f"{WHAT}: copying bucket {i + 1} of {len(layout)} into the model: {err}")
        try:
            worst = group.confirm(GO if failure is None else REFUSED)
            if worst != GO:
                raise failure or BiEngineError(f"{WHAT}: another member of weight-update group '{group_name}' "
                                               "could not copy the update into its model")
        except BiEngineError as err:
            self._broke(err, applied, len(layout), len(layout))
            raise
        e.after_weight_update(flush_cache=flush_cache, version=weight_version)
        for seq in e.requests.values():  # queued, not started (checked): they run wholly on the new weights
            seq.weight_version = e.weight_version
        self.landed(steps)
        return len(steps)

    def _check(self, names, dtypes, shapes, weight_version, abort_all: bool = False):
        """(metadata, copy steps, None), or (metadata or None, None, the refusal): nothing raised, so
        that a refusal still takes part in the handshake."""
        meta = None
        try:
            meta = parse_metadata(names, dtypes, shapes)
            if weight_version is not None and (not isinstance(weight_version, int) or isinstance(weight_version, bool)
                                               or weight_version < 0):
                raise RequestError(f"weight_version must be an int >= 0 or None, got {weight_version!r}")
            self.engine.rollout.refuse_if_asleep(WHAT, "weights")
            begun = [rid for rid, s in self.engine.requests.items() if started(s)]
            if begun and not abort_all:
                raise RequestError(f"{len(begun)} request(s) have started (e.g. request {begun[0]}); their tokens "
                                   "would mix two models. Pause with mode 'abort' or 'wait' first (a request kept "
                                   "by mode 'keep' has started), or let them finish")
            source = TensorDict([(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in zip(*meta)])
            check_vision_update(self.engine.runner.vision, source, in_memory=True)
            return meta, check_update(self.engine.model, source), None
        except BiEngineError as err:
            kind = RequestError if isinstance(err, RequestError) else CheckpointError
            return meta, None, kind(f"{WHAT}: {str(err).removeprefix('update_weights: ')}")
