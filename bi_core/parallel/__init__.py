"""Tensor parallelism: process groups (``state``), how each weight is split (``shard``), the
collectives' algorithms (``collectives``) and the lock-step launch of one engine per GPU
(``lockstep``). TP=1 touches none of it: the engine runs in-process exactly as before."""
