"""Seconds to import what an engine start imports, one module after another in this process:
``python3 dev/probes/import_time.py`` (run twice: the first run may compile bytecode)."""

import importlib
import time

for name in ("torch", "triton", "flashinfer", "fla.ops.gated_delta_rule", "transformers", "bi_core"):
    t = time.perf_counter()
    importlib.import_module(name)
    print(f"import {name}: {time.perf_counter() - t:.2f} s", flush=True)
