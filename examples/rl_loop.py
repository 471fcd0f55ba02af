"""An RL loop driving bi-engine from a trainer process: generate -> train -> pause -> weight sync ->
resume -> generate, the rollouts labelled with the weights that made them.

Two processes, as in a real setup: the engine (here started by this script; in production a
``bi-engine serve`` process, or engine actors) and the trainer (this process). The trainer talks
to the engine through ``call`` (here a pipe to the engine process running the Python API; over
HTTP it would be a POST to the server's routes of the same names) and sends weights over a
torch.distributed group of its own with ``bi_core.rl.WeightSender`` (gloo on the CPU, NCCL
between GPUs). Runs on the CPU with a tiny random model in well under a minute:

    python examples/rl_loop.py --steps 3

To use a real model: set ``ENGINE_CONFIG``'s model to ``{"path": "/models/Qwen3.5-..."}`` and
let the trainer send its own model's ``named_parameters()`` (Hugging Face names work as they are).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket

import torch

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.rl import WeightSender

ENGINE_CONFIG = {
    "model": {"random": {"preset": "tiny-dense", "seed": 0}, "dtype": "float32", "device": "cpu",
              "max_model_len": 512},
    "backend": "reference",
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256},
    "cache": {"block_size": 16, "num_blocks": 256},
}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42], list(range(100, 140))]
ROLLOUT = SamplingParams(n=4, temperature=1.0, seed=7, max_new_tokens=12)

# The engine calls the trainer may make (a server would expose these as routes).
ALLOWED = {"generate", "pause_generation", "resume_generation", "init_weights_update_group",
           "update_weights_from_distributed", "destroy_weights_update_group"}


# ------------------------------------------------------------------ the engine process


def engine_main(conn, config: dict) -> None:
    """Serve the trainer's calls on ``conn`` until it says stop: each (name, args, kwargs) is one
    engine call; the answer is ("ok", result) or ("error", message)."""
    engine = build_engine(EngineConfig.from_dict(config))
    conn.send(("ok", "ready"))
    while True:
        name, args, kwargs = conn.recv()
        if name == "stop":
            return
        try:
            if name not in ALLOWED:
                raise ValueError(f"unknown call {name!r}")
            result = getattr(engine, name)(*args, **kwargs)
            if name == "generate":  # what a trainer keeps of a rollout: tokens, logprobs, weight version
                result = [[(s.token_ids, s.token_logprobs, s.weight_version) for s in o.outputs] for o in result]
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - handed to the trainer
            conn.send(("error", f"{type(e).__name__}: {e}"))


class EngineClient:
    """The trainer's handle on the engine process: ``client.call("generate", prompts, params)``."""

    def __init__(self, config: dict) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(theirs, config), daemon=True)
        self.proc.start()
        self.answer()

    def call(self, name: str, *args, **kwargs):
        self.conn.send((name, args, kwargs))
        return self.answer()

    def send_call(self, name: str, *args, **kwargs) -> None:
        """Start a call whose answer comes later (``answer``): one that blocks until we join a group."""
        self.conn.send((name, args, kwargs))

    def answer(self):
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"the engine said: {value}")
        return value

    def close(self) -> None:
        self.conn.send(("stop", (), {}))
        self.proc.join(30)


# ------------------------------------------------------------------ the trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_step(policy: torch.nn.Module, step: int) -> None:
    """Stand-in for an optimizer step: nudge every weight."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())


def main(steps: int = 3) -> list[int]:
    """Run the loop; returns the weight version of each round's rollouts."""
    engine = EngineClient(ENGINE_CONFIG)
    # the trainer's policy: here the same tiny model, built locally (a real trainer has its own)
    policy = build_engine(EngineConfig.from_dict(ENGINE_CONFIG)).model
    port = free_port()
    engine.send_call("init_weights_update_group", "127.0.0.1", port, 1, 2)  # engine rank 0 -> group rank 1
    sender = WeightSender("127.0.0.1", port, world_size=2)  # trainer = rank 0; returns once the engine joined
    engine.answer()
    versions = []
    try:
        for step in range(steps + 1):
            rollouts = engine.call("generate", PROMPTS, ROLLOUT)
            version = rollouts[0][0][2]
            versions.append(version)
            first = rollouts[0][0][0]
            print(f"round {step}: weight_version={version}, {sum(len(g) for g in rollouts)} samples, "
                  f"prompt 0 sample 0: {first}")
            if step == steps:
                break
            train_step(policy, step)
            engine.call("pause_generation", mode="abort")  # nothing runs while the weights change
            def request_update(names, dtypes, shapes, version=step + 1):  # runs beside the broadcasts
                return engine.call("update_weights_from_distributed", names, dtypes, shapes, weight_version=version)

            n = sender.send(policy.named_parameters(), request_update, bucket_mb=0.5)
            engine.call("resume_generation")
            print(f"  synced {n} tensors -> weight_version {step + 1}")
        engine.call("destroy_weights_update_group")
    finally:
        sender.close()
        engine.close()
    return versions


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (weight syncs)")
    print("weight versions of the rollouts:", main(parser.parse_args().steps))
