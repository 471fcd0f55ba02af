"""LoRA adapters in rollouts: PEFT's format read (``peft.py``), the model's projections given
per-slot adapter stacks (``targets.py``), slots and versions handed to requests (``manager.py``)."""
