"""Compile manifests: the Triton kernels one engine start compiled, written down to be compiled
ahead by the next start of the same shape (``runtime/compile_ahead.py``).

- ``recording``: Triton's ``jit_post_compile_hook`` notes every kernel compiled (or loaded from
  the disk cache) in the process: ``module:qualname``, the compile's hash, and the specialization
  data Triton itself writes for ``JITFunction.preload``.
- ``key_fields`` / ``manifest_key``: a manifest is for one backend, GPU capability, Triton
  major.minor and the settings that shape kernel specializations; the key is a hash of them.
- Shipped manifests live in the backend's folder (``Backend.compile_manifests``; the CUDA
  backends': ``backends/cuda_common/compile_manifests``), one file per key.

Record one with ``python3 benchmarks/start_time.py CONFIG --record-compiles`` on an empty
``TRITON_CACHE_DIR`` on the GPU; re-record after changing kernels. Each entry of a bi_core kernel
keeps the hashes of the files its compile depends on (``kernel_sources``: Triton's key covers a
kernel's text and lines, and those of the JIT functions it calls): a start skips the entries whose
files changed (``changed_sources``), and a CPU test fails while a shipped manifest has such
entries. (An entry that compiles to another hash anyway is refused by ``compile_ahead``.)"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from bi_core.runtime import kernel_keys
from bi_core.runtime.build import resolve_max_model_len

if TYPE_CHECKING:
    from bi_core.config import EngineConfig
    from bi_core.models.args import ModelArgs
    from bi_core.policies.base import Policy
    from bi_core.registry import Registry

log = logging.getLogger(__name__)

WHAT = "Triton kernels one engine start compiles, replayed ahead by bi_core.runtime.compile_ahead"
RECORD_HOW = "python3 benchmarks/start_time.py CONFIG --record-compiles (on an empty TRITON_CACHE_DIR)"
# ModelArgs fields (and FP8 scheme fields) that name or describe, not shape, a kernel
# kv_cache_dtype: keyed as cache.kv_cache_dtype; the M-RoPE layout shapes no kernel (its positions are data)
_NOT_SHAPING = frozenset({"eos_token_ids", "origin", "kv_cache_dtype", "mrope_section", "mrope_interleaved"})


def key_fields(config: EngineConfig, policy: Policy, args: ModelArgs, *, capability: str,
               triton_version: str) -> dict:
    """What decides the Triton specializations an engine start compiles, as JSON values: the
    backend and mode, the model's shape, dtype, the KV page size, the scheduler's and the
    graphs' sizes, the strategy, the GPU (``sm90``) and Triton (``3.6``). Seeds, sampling and
    the server's settings are not in it. A field left out here costs wasted compiles, never
    results (only kernels that compile to their recorded hash are installed)."""
    def serialize(_inst, _field, value):
        return sorted(value) if isinstance(value, (set, frozenset)) else value

    def pick(section, *names):
        return {n: getattr(section, n) for n in names}

    model = attrs.asdict(args, filter=lambda a, _: a.name not in _NOT_SHAPING, value_serializer=serialize)
    fields = {
        "backend": policy.backend, "policy": attrs.asdict(config.policy), "model": model,
        "dtype": config.model.dtype, "max_model_len": resolve_max_model_len(config, args),
        "routed_experts": config.model.enable_return_routed_experts,
        "cache": pick(config.cache, "block_size", "num_blocks", "kv_cache_dtype", "ssm_state_dtype",
                      "prefix_caching"),
        "scheduler": attrs.asdict(config.scheduler),
        "graph": pick(config.graph, "enabled", "max_batch_size", "mixed"),
        "strategy": pick(config.strategy, "name", "num_speculative_tokens", "draft_vocab_size"),
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "capability": capability, "triton": triton_version,
    }
    return json.loads(json.dumps(fields))  # as a manifest file holds them (tuples are lists)


def manifest_key(fields: dict) -> str:
    """A short stable name for ``fields``: the hash of their canonical JSON."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def manifest_name(fields: dict) -> str:
    return f"{fields['capability']}_{fields['backend']}_{manifest_key(fields)}.json"


def manifest_target(config: EngineConfig, registry: Registry, policy: Policy, args: ModelArgs,
                    device: torch.device) -> tuple[dict, Path | None]:
    """This start's key fields, and where its backend ships the manifest for them (None: the
    backend ships none). Needs the GPU (its capability) and Triton."""
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = "sm{}{}".format(*torch.cuda.get_device_capability(index))
    fields = key_fields(config, policy, args, capability=capability,
                        triton_version=".".join(triton.__version__.split(".")[:2]))
    backend = registry.backends.get(policy.backend)
    folder = getattr(backend, "compile_manifests", None)
    return fields, (Path(folder) / manifest_name(fields) if folder is not None else None)


def write_manifest(path: Path | str, fields: dict, entries: list[dict], **header) -> None:
    """The manifest for ``fields``: a header (what it is for, ``header``'s items) and the entries."""
    import triton

    doc = {"what": WHAT, "key": manifest_key(fields), "backend": fields["backend"],
           "capability": fields["capability"], "triton": triton.__version__, **header, "fields": fields,
           "entries": entries}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def read_entries(path: Path, fields: dict) -> list[dict]:
    """The entries of the manifest at ``path``; raises ValueError when it is not for ``fields``."""
    doc = json.loads(Path(path).read_text())
    if doc.get("key") != manifest_key(fields) or not isinstance(doc.get("entries"), list):
        raise ValueError(f"{path} is not a compile manifest for key {manifest_key(fields)}")
    return doc["entries"]


@functools.cache
def kernel_sources(module: str) -> dict[str, str]:
    """The files whose text decides how a kernel of bi_core module ``module`` compiles: the
    module's and, transitively, those of the ``bi_core.kernels`` modules it imports from; path
    from the repository root -> the first 16 hex digits of its sha256. Other packages' kernels
    (fla): none (their version pins them)."""
    if not module.startswith("bi_core."):
        return {}
    root = Path(__file__).resolve().parents[2]
    found, todo = {}, [module]
    while todo:
        path = Path(importlib.util.find_spec(todo.pop()).origin).resolve()
        rel = path.relative_to(root).as_posix()
        if rel in found:
            continue
        text = path.read_bytes()
        found[rel] = hashlib.sha256(text).hexdigest()[:16]
        todo += [node.module for node in ast.walk(ast.parse(text))
                 if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bi_core.kernels")]
    return dict(sorted(found.items()))


def changed_sources(entry: dict) -> list[str]:
    """The files of ``entry``'s kernel that differ from when it was recorded (an entry recorded
    without ``sources``: none known)."""
    recorded = entry.get("sources")
    if recorded is None:
        return []
    now = kernel_sources(entry["kernel"].partition(":")[0])
    return sorted(p for p in recorded.keys() | now.keys() if recorded.get(p) != now.get(p))


def resolve(name: str):
    """The object that preloads kernel ``module:qualname``: the attribute path in the module,
    unwrapped through Triton's autotuners and heuristics (``.fn``) to the ``JITFunction``."""
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if (kernel := kernel_keys.unwrap(obj, "preload")) is None:
        raise LookupError(f"{name} is not a Triton kernel (no preload on it or through .fn)")
    return kernel


@attrs.define
class Recording:
    """The kernels compiled (or loaded from the disk cache) while recording, by (kernel, launch key)."""

    found: dict[tuple[str, str], dict] = attrs.field(factory=dict)
    unrecorded: int = 0  # compiles that could not be written down (see ``add``), counted

    def entries(self) -> list[dict]:
        """Each compiled specialization once, in a stable order."""
        return [self.found[k] for k in sorted(self.found)]

    def add(self, call: dict) -> None:
        """One ``jit_post_compile_hook`` call. Skipped (counted): specialization data Triton could
        not serialize, a kernel that ``resolve`` would not find again (defined in a function),
        a compile without a hash. Never raises: recording must not break a launch."""
        try:
            info, compiled = call["fn"], call["compile"]
            name, data = f"{info.module}:{info.name}", compiled["specialization_data"]
            kernel = info.jit_function.device_caches[compiled["device"]][0].get(call["key"])
            if data is None or not getattr(kernel, "hash", None) or resolve(name) is not info.jit_function:
                raise ValueError("not replayable")
            spec = _portable(json.loads(data))
            self.found[(name, spec["key"])] = {"kernel": name, "hash": kernel.hash,
                                               "sources": kernel_sources(info.module), "spec": spec}
        except Exception as e:
            self.unrecorded += 1
            log.debug("compile manifest: a compile not recorded (%s: %s)", type(e).__name__, e)


def _portable(spec: dict) -> dict:
    """Triton writes its libdevice's path into every kernel's options; left out, the replaying
    machine fills in its own (the recorded hash still checks the file's contents)."""
    libs = spec.get("options", {}).get("extern_libs")
    if libs and all(lib[0] == "libdevice" for lib in libs):
        del spec["options"]["extern_libs"]
    return spec


_recording: Recording | None = None


def is_recording() -> bool:
    return _recording is not None


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Within the block, every JIT compile in the process is written down (``Recording``), and
    engines built start no replay (a recording must see each compile happen). The hook already
    set is still called; both it and Triton's serializer are restored after."""
    global _recording
    import triton.runtime.jit as jit
    from triton import knobs

    try:  # keys that do not depend on the order this process launches its kernels in
        kernel_keys.settle()
    except Exception as e:  # recorded keys may then depend on that order (stale at some replays)
        log.warning("compile manifest: kernel keys not settled (%s: %s)", type(e).__name__, e)

    rec, previous = Recording(), knobs.runtime.jit_post_compile_hook
    serialize = jit.serialize_specialization_data

    def hook(**call):
        rec.add(call)
        return previous(**call) if previous is not None else None

    def safe_serialize(*args, **kwargs):  # Triton serializes before calling the hook: a constant
        try:  # json cannot write (a function passed as a constexpr) must not fail the launch
            return serialize(*args, **kwargs)
        except Exception:
            return None

    knobs.runtime.jit_post_compile_hook, jit.serialize_specialization_data = hook, safe_serialize
    _recording = rec
    try:
        yield rec
    finally:
        knobs.runtime.jit_post_compile_hook, jit.serialize_specialization_data = previous, serialize
        _recording = None
