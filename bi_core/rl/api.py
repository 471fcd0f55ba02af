"""The engine's API for RL trainers and weights, mixed into ``LLMEngine`` (``runtime/engine.py``
holds requests and the step loop): in-process weight updates, weight sync from a trainer process
(``receiver.py``; the protocol in ``sync_protocol.py``), generation control around a sync
(``rollout_control.py``: pause, sleep) and vLLM's ``collective_rpc`` (``collective_rpc.py``). Each method is thin:
the machinery lives in those modules, its state in ``engine.rollout`` (RolloutControl),
``engine.weight_sync`` (WeightSync) and ``engine.worker`` (RankWorker)."""

from __future__ import annotations

from pathlib import Path

import torch

from bi_core.errors import RequestError
from bi_core.models.loader import CheckpointIndex, TensorDict, apply_update, check_update
from bi_core.models.vision_weights import apply_vision_update, check_vision_update
from bi_core.rl.collective_rpc import collective_rpc
from bi_core.rl.tensors import LOAD_FORMATS, deserialize_named_tensors


class RolloutAPI:
    """Methods of ``LLMEngine`` (they use its model, cache, requests and lock-step driver)."""

    def abort_all(self) -> int:
        """Abort every unfinished request (``finish_reason='abort'``); returns how many."""
        rids = list(self.requests)
        for rid in rids:
            if rid in self.requests:  # a prompt's samples not yet forked went with their leader
                self.abort(rid)
        return len(rids)

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights, *, abort_unfinished: bool = False, flush_cache: bool = True,
                       version: int | None = None) -> int:
        """Copy new weights into the model's parameters in place (CUDA graphs stay valid); returns
        how many tensors were copied. ``weights``: a checkpoint directory, a ``{name: tensor}``
        mapping (a trainer's ``state_dict``) or ``(name, tensor)`` pairs, Hugging Face or engine
        names, any subset, any device; each in the engine's dtype or float32 (rounded as ``.to()``
        rounds), anything else refused. Every name, shape and dtype is checked before anything
        changes (a refused update copies and aborts nothing). Unfinished requests would mix two
        models: they are an error, or aborted with ``abort_unfinished=True``. Cached prefixes are
        dropped (kept with ``flush_cache=False``, one rank only); results then carry ``version``
        (default: the next number)."""
        if not flush_cache and self._driver is not None:
            raise RequestError("update_weights: flush_cache=False is supported with one rank only (every rank's "
                               "prefix cache must stay the same under tensor parallelism)")
        self.rollout.refuse_if_asleep("update_weights", "weights")
        if self.requests and not abort_unfinished:
            raise RequestError(f"update_weights: {len(self.requests)} request(s) unfinished; their tokens would "
                               "mix two models. Finish them, or pass abort_unfinished=True")
        is_path = isinstance(weights, (str, Path))
        source = CheckpointIndex(weights) if is_path else TensorDict(weights)
        steps = check_update(self.model, source)  # raises before any request is aborted or any rank is sent to
        vision = check_vision_update(self.runner.vision, source, in_memory=not is_path)
        for rid in list(self.requests):
            self.abort(rid)
        if self._driver is not None:  # tensor parallel: the aborts go first, then every rank takes its shard
            self._driver.send_update(str(weights) if is_path else source, [st.name for st in steps], self.device)
        count = apply_update(self.model, source, steps) + apply_vision_update(self.runner.vision, source, vision)
        self.after_weight_update(flush_cache, version)
        self.weight_sync.landed(steps)
        return count

    def update_weights_from_tensor(self, serialized_named_tensors: list[str | bytes], *,
                                   load_format: str | None = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False, weight_version: int | None = None) -> int:
        """SGLang's ``update_weights_from_tensor``: weights a trainer process shares by handle (CUDA
        IPC on this GPU, shared memory on the CPU), made with ``bi_core.rl.serialize_named_tensors``.
        One payload per tensor-parallel rank, as SGLang sends, or one for all: rank 0 opens the
        first and sends every rank its shard. Then as ``update_weights`` (names, shapes and dtypes
        checked before anything changes); returns how many tensors were copied."""
        if load_format not in LOAD_FORMATS:
            raise RequestError(f"update_weights_from_tensor: load_format {load_format!r} is not supported "
                               "(None or 'direct': a list of (name, tensor) pairs)")
        payloads = [serialized_named_tensors] if isinstance(serialized_named_tensors, (str, bytes)) \
            else list(serialized_named_tensors)
        if len(payloads) not in (1, self.tp.world):
            raise RequestError(f"update_weights_from_tensor: {len(payloads)} payloads; expected 1 or one per "
                               f"tensor-parallel rank ({self.tp.world})")
        # the opened handles go with this frame: the trainer's memory is its own again on return
        return self.update_weights(deserialize_named_tensors(payloads[0]), abort_unfinished=abort_all_requests,
                                   flush_cache=flush_cache, version=weight_version)

    def after_weight_update(self, flush_cache: bool = True, version: int | None = None) -> None:
        """New weights are in (every rank): cached prefixes are stale (dropped unless ``flush_cache``
        is False), results get a new version (``version``, else the next)."""
        self.model.refresh_draft_head()
        if flush_cache and self.cache.prefix is not None:
            self.cache.prefix.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.weight_version = self.weight_version + 1 if version is None else version

    # ------------------------------------------------------------------ RL: pause, weight sync (bi_core/rl)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """Stop generating: mode ``abort`` (abort every unfinished request), ``wait`` (run the
        started ones to their end here, hold the rest) or ``keep`` (freeze them; they go on after
        ``resume_generation``, bitwise as if never paused); ``clear_cache`` resets the prefix cache."""
        self.rollout.pause(mode, clear_cache)

    def resume_generation(self) -> None:
        self.rollout.resume()

    def is_paused(self) -> bool:
        return self.rollout.paused

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (running requests keep their pages); False if prefix caching is off."""
        return self.rollout.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Release device memory for a trainer sharing the GPU: the KV cache and GDN states, the CUDA
        graphs and the weights (level 1: kept in host memory; level 2: dropped, for a weight update
        to refill). Started requests must have ended (``pause_generation`` first)."""
        self.rollout.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate again what ``sleep`` released: tags ``weights``, ``kv_cache`` (None: both)."""
        self.rollout.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.runner.sleeping)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout_s: float = 300.0, wait: bool = True):
        """Join a trainer's weight-update group: trainer rank 0, engine rank r at ``rank_offset + r``;
        backend None: nccl on CUDA, gloo on the CPU (``bi_core.rl.sync_protocol``). The rendezvous runs in
        a thread, at most ``timeout_s``; ``wait``: block until every member joined (its failure
        raised; returns None). Without, this returns the ``joining.Join`` at once and the engine
        steps on meanwhile (the group is usable once it is done; an update of it first waits)."""
        join = self.weight_sync.init_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                                           timeout_s, wait=wait)
        return None if wait else join

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: int | None = None, abort_all_requests: bool = False) -> int:
        """Receive tensors broadcast by the trainer (``bi_core.rl.WeightSender``): checked like
        ``update_weights`` before anything is received, refused while a request has started
        (pause first, or ``abort_all_requests``: every unfinished request is aborted once the
        update has passed its checks); returns how many tensors were copied. ``weight_version``:
        the new version (else the next)."""
        return self.weight_sync.receive(names, dtypes, shapes, group_name, flush_cache, weight_version,
                                        abort_all_requests)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.weight_sync.destroy_group(group_name)

    # ------------------------------------------------------------------ collective RPC (vLLM)

    def collective_rpc(self, method: str, args=(), kwargs: dict | None = None, timeout: float | None = None) -> list:
        """vLLM's ``collective_rpc``: call ``method(*args, **kwargs)`` on every tensor-parallel rank's
        worker (``bi_core.rl.collective_rpc.RankWorker``: ``report_device_id``, ``weight_version``,
        ``weight_checksum``, and the methods of ``parallel.worker_extension_cls``); returns one result
        per rank, in rank order. An unknown or private (``_``) method is a RequestError; a method that
        raises on any rank, or a call longer than ``timeout`` seconds, a CollectiveRpcError naming it."""
        return collective_rpc(self, method, args, kwargs, timeout)
