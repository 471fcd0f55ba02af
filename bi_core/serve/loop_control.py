"""The engine loop's control calls (``loop.py``'s ``EngineLoop`` mixes them in): each runs between
steps and returns its answer's value; what it changed goes out as deltas before the answer. A
weight-update group's join returns its ``Join`` instead: the loop answers it when the rendezvous
ends (``_answer_joins``), stepping meanwhile."""

from __future__ import annotations

import json
import logging
import time

from bi_core.errors import (
    BiEngineError,
    CheckpointError,
    CollectiveRpcError,
    ConfigError,
    LoraError,
    RequestError,
)
from bi_core.rl.joining import Join
from bi_core.serve.messages import (
    AbortRequests,
    CollectiveRpc,
    ControlDone,
    ControlFailed,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensor,
    PauseGeneration,
    ResumeGeneration,
    Sleep,
    UnloadLoraAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    WakeUp,
)

log = logging.getLogger("bi_core.serve.loop")
# a control call's error from a bad argument (answered 400); any other exception is the engine's failure (500)
INVALID_ARGUMENT = (RequestError, ConfigError, CheckpointError, ValueError)


class _Failed(Exception):
    """A control call refused by the loop itself (its reason: messages.ControlFailure)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ControlCalls:
    """The control calls of ``EngineLoop`` (it holds the engine, the channel and the tracked requests)."""

    def _control(self, msg) -> None:
        """Run one control call; the deltas of what it changed go out before its answer (a weight
        group's join is answered when its rendezvous ends: ``_answer_joins``)."""
        try:
            value = self._controls[type(msg)](msg)
            if isinstance(value, Join):
                self.joins[msg.key] = value
                return
            answer = ControlDone(msg.key, value)
        except _Failed as e:
            answer = ControlFailed(msg.key, e.reason, str(e))
        except INVALID_ARGUMENT as e:
            answer = ControlFailed(msg.key, "invalid", str(e))
        except Exception as e:  # noqa: BLE001 - the engine's failure: its traceback to the log, its message back
            log.exception("control call %s failed", type(msg).__name__)
            answer = ControlFailed(msg.key, "error", f"{type(msg).__name__} failed: {type(e).__name__}: {e}")
        self._sweep()
        self._flush()
        self.channel.send(answer)
        self._release_held()

    def _refresh(self, sleep: bool = False) -> None:
        """Read the engine's pause state (and with ``sleep`` its sleep state) after a call that may change it."""
        self.paused = bool(self.engine.is_paused())
        if sleep:
            self.sleeping = bool(self.engine.is_sleeping())

    def _sweep(self) -> None:
        """The deltas of what a control call changed: tokens a pause in mode wait generated, the
        last deltas of the requests it ended (aborted by a pause, an abort, an update)."""
        now = time.monotonic()
        for rid, t in list(self.tracked.items()):
            self._emit(rid, t, now)

    def _pause(self, m: PauseGeneration) -> str:
        try:
            self.engine.pause_generation(mode=m.mode, clear_cache=m.clear_cache)
        finally:
            self._refresh()
        return "paused"

    def _resume(self, m: ResumeGeneration) -> str:
        self.engine.resume_generation()
        self.resume_on_wake = False
        self._refresh()
        return "resumed"

    def _abort_requests(self, m: AbortRequests) -> int:
        if m.request_ids is not None:
            return sum(self._abort(rid, m.message) for rid in m.request_ids)
        n = int(self.engine.abort_all())
        if m.message is not None:  # their last deltas (the sweep after this call) carry it
            for t in self.tracked.values():
                if t.seq.finish_reason == "abort":
                    t.seq.error = m.message
        return n

    def _sleep(self, m: Sleep) -> None:
        """vLLM's sleep: pause in ``m.mode`` unless paused (waking up fully resumes), then sleep."""
        if m.level not in (1, 2):
            raise _Failed("invalid", f"level must be 1 (weights to host memory) or 2 (weights dropped), got {m.level}")
        paused_here = not self.paused
        if paused_here:
            self.engine.pause_generation(mode=m.mode, clear_cache=False)
        try:
            self.engine.sleep(level=m.level)
        except BaseException:
            if paused_here:  # as it was before the call
                self.engine.resume_generation()
            raise
        finally:
            self._refresh(sleep=True)
        self.resume_on_wake = self.resume_on_wake or paused_here

    def _wake_up(self, m: WakeUp) -> None:
        self.engine.wake_up(tags=m.tags)
        self._refresh(sleep=True)
        if not self.sleeping and self.resume_on_wake:
            self.engine.resume_generation()
            self.resume_on_wake = False
            self._refresh()

    def _init_weights_update_group(self, m: InitWeightsUpdateGroup) -> Join:
        """Checked here (a bad call is answered at once), joined in a thread: the loop steps on."""
        return self.engine.init_weights_update_group(m.master_address, m.master_port, m.rank_offset, m.world_size,
                                                     group_name=m.group_name, backend=m.backend,
                                                     timeout_s=self.weight_sync_timeout_s, wait=False)

    def _answer_joins(self) -> None:
        """Answer the init calls whose rendezvous ended (joined, failed, timed out)."""
        for key, join in list(self.joins.items()):
            if not join.done():
                continue
            del self.joins[key]
            try:
                self.engine.weight_sync.settle(join)
                answer = ControlDone(key, None)
            except BiEngineError as e:  # the trainer did not join in time, went away, or the group was destroyed
                answer = ControlFailed(key, "invalid", f"{e} (serve.weight_sync_timeout_s="
                                                       f"{self.weight_sync_timeout_s:g})")
            except Exception as e:  # noqa: BLE001 - the engine's failure: its traceback to the log
                log.exception("joining weight-update group %r failed", join.name)
                answer = ControlFailed(key, "error", f"InitWeightsUpdateGroup failed: {type(e).__name__}: {e}")
            self._flush()
            self.channel.send(answer)

    def _give_up_joins(self) -> None:
        """At shutdown: a rendezvous still running is given up, its call answered."""
        if not self.joins:
            return
        for key, join in self.joins.items():
            self.channel.send(ControlFailed(key, "unavailable", f"the server is shutting down: weight-update group "
                                                                f"'{join.name}' was still being joined"))
        self.joins.clear()
        self.engine.weight_sync.abandon_joins()

    def _update_weights_from_distributed(self, m: UpdateWeightsFromDistributed) -> dict:
        try:  # the engine aborts (abort_all) only once the update has passed its checks
            n = self.engine.update_weights_from_distributed(
                m.names, m.dtypes, m.shapes, group_name=m.group_name, flush_cache=m.flush_cache,
                weight_version=m.weight_version, abort_all_requests=m.abort_all)
        finally:
            self._sweep()
        return {"num_tensors": int(n), "weight_version": int(self.engine.weight_version)}

    def _update_weights_from_tensor(self, m: UpdateWeightsFromTensor) -> dict:
        try:  # as above: checked first, then aborted
            n = self.engine.update_weights_from_tensor(m.payloads, load_format=m.load_format,
                                                       flush_cache=m.flush_cache, weight_version=m.weight_version,
                                                       abort_all_requests=m.abort_all)
        finally:
            self._sweep()
        return {"num_tensors": int(n), "weight_version": int(self.engine.weight_version)}

    def _update_weights_from_disk(self, m: UpdateWeightsFromDisk) -> dict:
        try:
            n = self.engine.update_weights(m.path, abort_unfinished=m.abort_all)
        finally:
            self._sweep()  # the requests it aborted (once the checkpoint passed its checks) end here
        return {"num_tensors": int(n), "weight_version": int(self.engine.weight_version)}

    def _load_lora_adapter(self, m: LoadLoraAdapter) -> dict:
        if m.name in self.engine.lora.current and not m.load_inplace:  # vLLM's answer; in place: a new version
            raise _Failed("invalid", f"The lora adapter '{m.name}' has already been loaded; pass load_inplace: true "
                                     "to load this one as its next version")
        try:
            x = self.engine.load_lora_adapter(m.name, m.path)
        except LoraError as e:
            raise _Failed("invalid", str(e)) from None
        return {"name": x.name, "version": x.version, "slot": x.slot, "source": x.source}

    def _load_lora_adapter_from_tensor(self, m: LoadLoraAdapterFromTensor) -> dict:
        try:  # a loaded name takes these tensors as its next version (a trainer's adapter sync)
            x = self.engine.load_lora_adapter_from_tensor(m.name, m.payload, m.config)
        except LoraError as e:
            raise _Failed("invalid", str(e)) from None
        return {"name": x.name, "version": x.version, "slot": x.slot, "source": x.source}

    def _unload_lora_adapter(self, m: UnloadLoraAdapter) -> dict:
        try:
            x = self.engine.unload_lora_adapter(m.name)
        except LoraError as e:
            raise _Failed("not_found" if e.not_found else "invalid", str(e)) from None
        return {"name": x.name, "version": x.version}

    def _collective_rpc(self, m: CollectiveRpc) -> list:
        try:
            results = self.engine.collective_rpc(m.method, tuple(m.args), dict(m.kwargs), timeout=m.timeout)
        except CollectiveRpcError as e:  # the method's failure, or a timeout: the caller's to read, not a bug to log
            raise _Failed("error", str(e)) from None
        finally:
            self._refresh(sleep=True)  # a method may pause the engine or put it to sleep
        return [_rpc_result(r) for r in results]


def _rpc_result(value: object) -> object:
    """vLLM's ``/collective_rpc`` answer for one rank: None, a dict or a list as it is (as JSON has it:
    tuples as lists, keys as strings), anything else (or a dict or list JSON cannot hold) its ``str()``."""
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        try:
            return json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            pass
    return str(value)
