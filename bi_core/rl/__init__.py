"""Driving the engine from an RL trainer (issue 24): weight sync from a trainer process
(``WeightSender`` here, ``LLMEngine.init_weights_update_group`` / ``update_weights_from_distributed``
/ ``destroy_weights_update_group`` on the engine; the protocol in ``sync_protocol.py``) and generation
control around it (``LLMEngine.pause_generation`` / ``resume_generation``, ``rollout_control.py``). A
trainer on the engine's GPU shares tensors by handle instead (``serialize_named_tensors``,
``LLMEngine.update_weights_from_tensor``; ``tensors.py``, read by ``handles.py``). Until a level-2
sleep's weights are synced again, requests raise ``WeightsMissing`` (``coverage.py``)."""

from __future__ import annotations

from bi_core.rl.coverage import WeightsMissing
from bi_core.rl.sender import WeightSender
from bi_core.rl.tensors import serialize_named_tensors

__all__ = ["WeightSender", "WeightsMissing", "serialize_named_tensors"]
