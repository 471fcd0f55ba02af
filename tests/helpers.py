"""Shared test helpers."""

from __future__ import annotations


def tiny_config(**overrides) -> dict:
    """A config dict for the tiny random preset on the reference backend, float32 on the CPU."""
    base = {
        "model": {"random": {"preset": "tiny-dense", "seed": 0}, "dtype": "float32", "device": "cpu",
                  "max_model_len": 512},
        "backend": "reference",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
        "cache": {"block_size": 16, "num_blocks": 256},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


SCRIPT_DIRS = ("benchmarks", "benchmarks/kernels", "dev/probes", "dev/gpu")  # where benchmark_module looks


def benchmark_module(name: str):
    """A script (``benchmarks/``, ``benchmarks/kernels/``, ``dev/probes/`` or ``dev/gpu/``) imported as
    a module by its name (its ``main`` not run)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    [path] = [root / d / f"{name}.py" for d in SCRIPT_DIRS if (root / d / f"{name}.py").is_file()]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reverse_prompt_piece_rows(graphs) -> None:
    """Negative control for the MTP head's prompt graphs: a graph runner whose mixed (prompt-piece)
    graphs are fed the piece's hidden rows in reverse order."""
    run = graphs.run

    def reversed_rows(step, ids, ctx, prepare=None, extra=None, ids_from=None):
        if ctx.graph is not None and ctx.graph.chunk and extra is not None:
            extra = extra.flip(0)
        return run(step, ids, ctx, prepare, extra, ids_from)
    graphs.run = reversed_rows
