"""Runtime: sequences, scheduler, KV/state cache, and the engine's step loop."""
