"""Driving the engine from an RL trainer (issue 24): weight sync from a trainer process
(``WeightSender`` here, ``LLMEngine.init_weights_update_group`` / ``update_weights_from_distributed``
/ ``destroy_weights_update_group`` on the engine; the protocol in ``protocol.py``) and generation
control around it (``LLMEngine.pause_generation`` / ``resume_generation``, ``control.py``)."""

from __future__ import annotations

from bi_core.rl.sender import WeightSender

__all__ = ["WeightSender"]
