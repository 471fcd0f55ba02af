"""Compile-ahead (``runtime/compile_ahead.py``, ``runtime/compile_manifest.py``) on the CPU: the
manifest key, the manifest file, resolving kernels, recording through Triton's hook, the replay's
failure isolation with stand-in kernels (a fake async mode, and Triton's own), and when a start
does nothing. The GPU half is ``tests/gpu/test_compile_ahead_gpu.py``."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig
from bi_core.policies.base import make_policy
from bi_core.policies.checks import planned_device
from bi_core.runtime import compile_ahead, compile_manifest
from bi_core.runtime.build import resolve_model

ROOT = Path(__file__).resolve().parents[2]


def fields_of(config: EngineConfig, capability: str = "sm90", triton_version: str = "3.6") -> dict:
    policy = make_policy(batch_invariant=config.policy.batch_invariant, backend=config.backend,
                         op_overrides=config.policy.ops, device=planned_device(config.model.device))
    args, _ = resolve_model(config)
    return compile_manifest.key_fields(config, policy, args, capability=capability, triton_version=triton_version)


def cuda_config(**overrides) -> EngineConfig:
    base = {"model": {"random": {"preset": "tiny-moe", "seed": 0}, "dtype": "bfloat16", "device": "cuda",
                      "max_model_len": 512}, "backend": "cuda_default", "graph": {"enabled": True}}
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return EngineConfig.from_dict(tiny_config(**base))


# ------------------------------------------------------------------------------------------ the key


def test_the_key_recipe_is_stable():
    """Shipped manifests are found by this hash: a changed recipe would orphan every one of them."""
    assert compile_manifest.manifest_key({"b": [1, 2], "a": {"y": None, "x": "s"}}) == "840bf3f267e0"
    assert compile_manifest.manifest_key({"a": {"x": "s", "y": None}, "b": [1, 2]}) == "840bf3f267e0"  # any order
    assert compile_manifest.manifest_key({"a": {"x": "s", "y": None}, "b": [2, 1]}) != "840bf3f267e0"


def test_the_35b_default_start_keeps_its_key():
    """The key of the start the shipped manifests are recorded for. If this fails on purpose (a
    field of ModelArgs or of the key changed), re-record the manifests (their file names hold
    the old key, so no start would find them) and put the new key here."""
    config = EngineConfig.from_yaml(ROOT / "benchmarks/configs/qwen35b_default.yaml")
    fields = fields_of(config)
    assert json.loads(json.dumps(fields)) == fields  # plain JSON values only
    assert fields["backend"] == "cuda_default" and fields["model"]["num_hidden_layers"] == 40
    assert compile_manifest.manifest_key(fields) == "c7055801186d"


def test_the_key_follows_what_shapes_kernels_and_nothing_else():
    key = compile_manifest.manifest_key
    base = key(fields_of(cuda_config()))
    assert key(fields_of(cuda_config())) == base
    shaping = [
        cuda_config(cache={"block_size": 32}), cuda_config(scheduler={"max_num_seqs": 16}),
        cuda_config(scheduler={"max_num_batched_tokens": 512}), cuda_config(scheduler={"prefill_chunk_size": 64}),
        cuda_config(model={"max_model_len": 256}), cuda_config(model={"dtype": "float32"}),
        cuda_config(backend="cuda_hopper_invariant", policy={"batch_invariant": True}),
        cuda_config(model={"random": {"preset": "tiny-moe", "seed": 0, "num_hidden_layers": 2}}),
        cuda_config(model={"random": {"preset": "tiny-dense", "seed": 0}}),
        cuda_config(graph={"max_batch_size": 4}), cuda_config(cache={"kv_cache_dtype": "fp8"}),
    ]
    for config in shaping:
        assert key(fields_of(config)) != base, config
    assert key(fields_of(cuda_config(), capability="sm100")) != base
    assert key(fields_of(cuda_config(), triton_version="3.7")) != base
    # negative control: seeds, sampling, the server and the start's own steps shape no kernel
    same = [
        cuda_config(seed=7), cuda_config(model={"random": {"preset": "tiny-moe", "seed": 3}}),
        cuda_config(sampling={"temperature": 0.7}), cuda_config(graph={"warmup": False, "overlap": False}),
        cuda_config(serve={"port": 9000}), cuda_config(cache={"gpu_memory_utilization": 0.5}),
    ]
    for config in same:
        assert key(fields_of(config)) == base, config


# ------------------------------------------------------------------------------------- the manifest


def test_a_manifest_round_trips_and_is_only_read_for_its_key(tmp_path):
    fields = fields_of(cuda_config())
    entries = [{"kernel": "m:k", "hash": "ab" * 32, "spec": {"key": "K", "options": {"num_warps": 4}}}]
    path = tmp_path / "sub" / compile_manifest.manifest_name(fields)
    compile_manifest.write_manifest(path, fields, entries, gpu="test")
    assert path.name == f"sm90_cuda_default_{compile_manifest.manifest_key(fields)}.json"
    assert compile_manifest.read_entries(path, fields) == entries
    doc = json.loads(path.read_text())
    assert doc["gpu"] == "test" and doc["fields"] == fields and doc["capability"] == "sm90"
    with pytest.raises(ValueError, match="not a compile manifest"):
        compile_manifest.read_entries(path, fields_of(cuda_config(cache={"block_size": 32})))


def _module(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_resolve_walks_the_qualname_and_unwraps_autotuners(monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    def kernel(X, N, BLOCK: triton.language.constexpr):
        pass

    jit = JITFunction(kernel)  # (not triton.jit: under TRITON_INTERPRET=1 that is the interpreter's)
    heuristics = triton.heuristics({"BLOCK": lambda a: 16})(jit)
    wrapped = triton.autotune(configs=[triton.Config({})], key=["N"])(heuristics)
    holder = types.SimpleNamespace(kernel=wrapped)
    _module(monkeypatch, "fake_kernels", wrapped=wrapped, holder=holder, plain=kernel)
    assert compile_manifest.resolve("fake_kernels:wrapped") is jit
    assert compile_manifest.resolve("fake_kernels:holder.kernel") is jit
    with pytest.raises(LookupError):  # negative control: a Python function is no kernel
        compile_manifest.resolve("fake_kernels:plain")
    with pytest.raises(AttributeError):
        compile_manifest.resolve("fake_kernels:missing")
    with pytest.raises(ImportError):
        compile_manifest.resolve("no_such_module_here:kernel")


# -------------------------------------------------------------------------------------- recording


class _Jit:
    """Stands in for a JITFunction as Triton's hook passes it: a preload and per-device caches."""

    def __init__(self, cached: dict) -> None:
        self.device_caches = {0: (cached, {}, None, None, None)}

    def preload(self, data):
        raise AssertionError("not called while recording")


def _call(jit, name: str, key: str, data) -> dict:
    """``jit_post_compile_hook``'s keyword arguments as Triton 3.6's ``_call_hook`` passes them."""
    module, _, qualname = name.partition(":")
    info = types.SimpleNamespace(module=module, name=qualname, jit_function=jit)
    return {"key": key, "repr": qualname, "fn": info, "is_manual_warmup": False, "already_compiled": False,
            "compile": {"key": key, "device": 0, "specialization_data": data, "configs": [{}]}}


def test_recording_writes_down_compiles_chains_the_hook_and_never_raises(monkeypatch):
    pytest.importorskip("triton")
    import triton.runtime.jit as jit_module
    from triton import knobs

    libdevice = [["libdevice", "/this/machine/triton/libdevice.10.bc"]]
    spec = {"name": "k", "key": "K1", "options": {"num_warps": 4, "extern_libs": libdevice}}
    good = _Jit({"K1": types.SimpleNamespace(hash="h1"), "K2": types.SimpleNamespace(hash="h2")})
    _module(monkeypatch, "fake_kernels", good=good, stray=_Jit({"K1": types.SimpleNamespace(hash="h3")}))
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **call: seen.append(call.get("key")))
    previous = knobs.runtime.jit_post_compile_hook

    def failing_serialize(*args, **kwargs):
        raise TypeError("not JSON serializable")

    monkeypatch.setattr(jit_module, "serialize_specialization_data", failing_serialize)
    with compile_manifest.recording() as rec:
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not previous and compile_manifest.is_recording()
        assert jit_module.serialize_specialization_data("k", {}, {}, {}, None, "K") is None  # no raise
        hook(**_call(good, "fake_kernels:good", "K1", json.dumps(spec)))
        hook(**_call(good, "fake_kernels:good", "K1", json.dumps(spec)))  # again: once in the manifest
        hook(**_call(good, "fake_kernels:good", "K2", None))  # Triton could not serialize it
        hook(**_call(good, "fake_kernels:good", "K3", json.dumps({**spec, "key": "K3"})))  # no hash
        hook(**_call(good, "fake_kernels:gone", "K1", json.dumps(spec)))  # not found again by name
        hook(**_call(good, "fake_kernels:stray", "K1", json.dumps(spec)))  # the name is another kernel
        hook(fn=None)  # whatever Triton passes, a launch must not fail here
    assert seen == ["K1", "K1", "K2", "K3", "K1", "K1", None]  # the hook set before still ran
    assert knobs.runtime.jit_post_compile_hook is previous and not compile_manifest.is_recording()
    assert jit_module.serialize_specialization_data is failing_serialize
    assert rec.unrecorded == 5
    [entry] = rec.entries()
    assert entry == {"kernel": "fake_kernels:good", "hash": "h1", "sources": {},  # not a bi_core module
                     "spec": {"name": "k", "key": "K1", "options": {"num_warps": 4}}}


def test_entries_come_out_once_each_in_a_stable_order():
    rec = compile_manifest.Recording()
    for name, key in [("m:b", "2"), ("m:a", "9"), ("m:b", "1"), ("m:a", "9")]:
        rec.found[(name, key)] = {"kernel": name, "key": key}
    assert [(e["kernel"], e["key"]) for e in rec.entries()] == [("m:a", "9"), ("m:b", "1"), ("m:b", "2")]


# ----------------------------------------------------------------------------------------- replay


class _Kernel:
    def __init__(self, name: str) -> None:
        self.name = name


class _FakeMode:
    """Triton's AsyncCompileMode as far as the replay uses it: ``submit`` hands the compile to the
    executor, leaving waits for each compile and installs what compiled (``finalize``)."""

    active = None

    def __init__(self, executor, *, ignore_errors=False) -> None:
        self.executor, self.pending = executor, []

    def submit(self, key, compile_fn, finalize_fn):
        future = self.executor.submit(compile_fn)
        self.pending.append((future, finalize_fn))
        return future

    def __enter__(self):
        _FakeMode.active = self
        return self

    def __exit__(self, *exc):
        for future, finalize in self.pending:
            if future.exception() is None:
                finalize(future.result())
        _FakeMode.active = None


class _StandIn:
    """A kernel whose preload submits one compile (keyed by the spec's ``cache_key``) to the active mode."""

    def __init__(self, name, installed, *, preload_error=None, compile_error=None, active=None) -> None:
        self.name, self.installed = name, installed
        self.preload_error, self.compile_error = preload_error, compile_error
        self.active = active or (lambda: _FakeMode.active)

    def preload(self, data: str):
        if self.preload_error:
            raise self.preload_error
        spec = json.loads(data)

        def compile_fn():
            if self.compile_error:
                raise self.compile_error
            return _Kernel(self.name)

        mode = self.active()
        arity = len(inspect.signature(type(mode).__mro__[1].submit).parameters)  # 3.6: 4, later: 5 (cleanup)
        extra = (lambda future_kernel: None,) * (arity - 4)
        finalize = lambda kernel: self.installed.append(kernel.name)
        return mode.submit(spec["cache_key"], compile_fn, finalize, *extra)


def _entry(name: str, *, stale: bool = False) -> dict:
    cache_key = f"cache-key-of-{name}"
    recorded = "another compile" if stale else cache_key
    return {"kernel": f"fake_kernels:{name}", "hash": hashlib.sha256(recorded.encode()).hexdigest(),
            "spec": {"cache_key": cache_key}}


NAMES = ("good", "no_preload", "preload_raises", "compile_raises", "stale", "launcher_raises", "good2")


def _stand_ins(monkeypatch, installed, **kwargs):
    _module(monkeypatch, "fake_kernels", good=_StandIn("good", installed, **kwargs),
            no_preload=types.SimpleNamespace(fn=None),
            preload_raises=_StandIn("preload_raises", installed, preload_error=RuntimeError("no"), **kwargs),
            compile_raises=_StandIn("compile_raises", installed, compile_error=RuntimeError("ptxas"), **kwargs),
            stale=_StandIn("stale", installed, **kwargs),
            launcher_raises=_StandIn("launcher_raises", installed, **kwargs),
            good2=_StandIn("good2", installed, **kwargs))
    return [_entry(n, stale=n == "stale") for n in NAMES] + [_entry("missing"), {"kernel": "fake_kernels:good"}]


def _launchers(built):
    def build(kernel):
        built.append((kernel.name, threading.current_thread().name))
        if kernel.name == "launcher_raises":
            raise OSError("gcc")
    return build


def test_a_failing_entry_is_counted_and_the_others_are_installed(monkeypatch):
    installed, built = [], []
    entries = _stand_ins(monkeypatch, installed)
    report = compile_ahead.replay(entries, 4, mode_cls=_FakeMode, build_launcher=_launchers(built))
    # not installed: no preload, preload raises, compile raises, stale, module attribute missing, no hash
    assert (report.entries, report.compiled, report.failed, report.stale) == (9, 3, 6, 1)
    assert sorted(installed) == ["good", "good2", "launcher_raises"]  # a failed launcher build costs nothing
    assert sorted(n for n, _ in built) == ["good", "good2", "launcher_raises"]
    assert all(t.startswith("bi-compile-ahead") for _, t in built)  # in the pool, after each compile


def test_replay_under_tritons_own_async_compile_mode(monkeypatch):
    """The same entries through Triton's AsyncCompileMode (this machine's Triton): its waiting and
    installing work with the replay's pool tasks and its hash check."""
    _async_compile = pytest.importorskip("triton.runtime._async_compile")
    installed, built = [], []
    entries = _stand_ins(monkeypatch, installed, active=_async_compile.active_mode.get)
    report = compile_ahead.replay(entries, 4, mode_cls=_async_compile.AsyncCompileMode,
                                  build_launcher=_launchers(built))
    assert (report.entries, report.compiled, report.failed, report.stale) == (9, 3, 6, 1)
    assert sorted(installed) == ["good", "good2", "launcher_raises"]
    assert _async_compile.active_mode.get() is None


def test_the_hash_check_is_what_keeps_a_stale_entry_out(monkeypatch):
    """Negative control for the stale entry above: recorded with its true hash, it is installed."""
    installed = []
    _stand_ins(monkeypatch, installed)
    report = compile_ahead.replay([_entry("stale")], 2, mode_cls=_FakeMode, build_launcher=lambda k: None)
    assert (report.compiled, report.failed, installed) == (1, 0, ["stale"])


def test_the_replay_thread_reports_once_and_never_fails_the_start(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=compile_ahead.__name__)
    monkeypatch.setattr(compile_ahead, "_create_driver", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    report = compile_ahead.AheadReport(entries=2, compiled=2, failed=0, stale=0, workers=4, seconds=0.5)
    monkeypatch.setattr(compile_ahead, "replay", lambda entries, workers: report)
    ahead = compile_ahead.CompileAhead()
    ahead.launch([{}, {}], 0)
    assert ahead.join() is report and report.join_wait_s >= 0
    assert ahead.join() is report  # once: no second wait, no second line
    assert [r.message for r in caplog.records] == [str(report)]

    def broken(entries, workers):
        raise RuntimeError("the driver went away")

    monkeypatch.setattr(compile_ahead, "replay", broken)
    ahead = compile_ahead.CompileAhead()
    ahead.launch([{}], 0)
    assert ahead.join() is None
    assert "compile-ahead stopped" in caplog.records[-1].message


# ------------------------------------------------------------------------------- when a start replays


@pytest.fixture
def start_env(monkeypatch):
    """``start`` on this CPU machine, short of CUDA: the capability lookup and the thread are stand-ins."""
    from bi_core.plugins import load_registry

    config = cuda_config()
    policy = make_policy(batch_invariant=False, backend="cuda_default", op_overrides={}, device="cuda")
    args, _ = resolve_model(config)
    calls = types.SimpleNamespace(launched=[], skipped=[], targets=0)
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    monkeypatch.setattr(compile_ahead, "_said", set())

    def launch(self, entries, index, skipped=0):
        calls.launched.append(entries)
        calls.skipped.append(skipped)

    monkeypatch.setattr(compile_ahead.CompileAhead, "launch", launch)

    def start(manifest: Path | None):
        def target(*_):
            calls.targets += 1
            return fields_of(config), manifest
        monkeypatch.setattr(compile_ahead, "manifest_target", target)
        return compile_ahead.start(config, load_registry(), policy, args, torch.device("cuda", 0))

    calls.start, calls.fields = start, fields_of(config)
    return calls


def test_a_start_replays_the_manifest_for_its_key(start_env, tmp_path):
    path = tmp_path / "m.json"
    compile_manifest.write_manifest(path, start_env.fields, [{"kernel": "m:k"}])
    ahead = start_env.start(path)
    assert start_env.launched == [[{"kernel": "m:k"}]] and ahead.path == path


def test_the_off_switch(start_env, tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    compile_manifest.write_manifest(path, start_env.fields, [{"kernel": "m:k"}])
    monkeypatch.setenv(compile_ahead.ENV, "0")
    ahead = start_env.start(path)
    assert start_env.launched == [] and start_env.targets == 0 and ahead.join() is None
    monkeypatch.setenv(compile_ahead.ENV, "1")  # negative control
    start_env.start(path)
    assert len(start_env.launched) == 1


def test_no_replay_while_recording_or_off_cuda(start_env, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    path = tmp_path / "m.json"
    compile_manifest.write_manifest(path, start_env.fields, [{"kernel": "m:k"}])
    with compile_manifest.recording():
        start_env.start(path)
    assert start_env.launched == [] and start_env.targets == 0
    from bi_core.plugins import load_registry

    config = cuda_config(model={"device": "cpu"}, backend="reference")
    args, _ = resolve_model(config)
    policy = make_policy(batch_invariant=False, backend="reference", op_overrides={}, device="cpu")
    assert compile_ahead.start(config, load_registry(), policy, args, torch.device("cpu")).join() is None
    assert start_env.targets == 0


def test_no_manifest_for_the_key_says_so_once_and_does_nothing(start_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=compile_ahead.__name__)
    for _ in range(2):
        assert start_env.start(tmp_path / "absent.json").join() is None
    other = tmp_path / "other.json"  # a manifest for another key under this name: not replayed
    compile_manifest.write_manifest(other, fields_of(cuda_config(cache={"block_size": 32})), [{"kernel": "m:k"}])
    start_env.start(other)
    assert start_env.launched == []
    lines = [r.message for r in caplog.records]
    assert len(lines) == 2 and "no compile manifest for key" in lines[0] and "--record-compiles" in lines[0]
    assert "off (ValueError" in lines[1] and "is not a compile manifest for key" in lines[1]


def test_a_triton_without_async_compile_mode_does_nothing_with_one_log_line(start_env, tmp_path, monkeypatch,
                                                                           caplog):
    caplog.set_level(logging.INFO, logger=compile_ahead.__name__)
    path = tmp_path / "m.json"
    compile_manifest.write_manifest(path, start_env.fields, [{"kernel": "m:k"}])
    monkeypatch.setitem(sys.modules, "triton.runtime._async_compile", None)  # Triton < 3.5: no such module
    for _ in range(2):
        assert start_env.start(path).join() is None
    assert start_env.launched == [] and start_env.targets == 0
    assert [r.message for r in caplog.records] == [
        "compile-ahead: off: this Triton has no AsyncCompileMode (3.5+); kernels compile at their first launch"]


def test_the_cuda_backends_name_their_manifest_folder():
    from bi_core.backends.cuda_common import COMPILE_MANIFESTS
    from bi_core.plugins import load_registry

    backends = load_registry().backends
    assert backends["cuda_default"].compile_manifests == COMPILE_MANIFESTS
    assert backends["cuda_hopper_invariant"].compile_manifests == COMPILE_MANIFESTS
    assert backends["reference"].compile_manifests is None
    for path in sorted(COMPILE_MANIFESTS.glob("*.json")):  # every shipped manifest is named by its key
        doc = json.loads(path.read_text())
        assert path.name == compile_manifest.manifest_name(doc["fields"]) and doc["key"] in path.name
        assert all({"kernel", "hash", "spec"} <= set(e) for e in doc["entries"])


# ------------------------------------------------------------------ kernel files changed since recording


def test_kernel_sources_follow_the_kernel_imports():
    """A bi_core kernel's compile depends on its module's text and, transitively, on the
    ``bi_core.kernels`` modules it imports JIT functions from; other packages' kernels list none."""
    norm = compile_manifest.kernel_sources("bi_core.kernels.norm")
    assert list(norm) == ["bi_core/kernels/common.py", "bi_core/kernels/e4m3.py", "bi_core/kernels/norm.py"]
    fp8_moe = compile_manifest.kernel_sources("bi_core.kernels.fp8_moe")
    assert {"bi_core/kernels/fp8.py", "bi_core/kernels/gemm.py", "bi_core/kernels/moe.py",
            "bi_core/kernels/common.py"} < set(fp8_moe)
    assert all(len(h) == 16 for h in fp8_moe.values())
    assert compile_manifest.kernel_sources("fla.ops.utils.cumsum") == {}


def test_an_entry_whose_kernel_file_changed_is_known():
    entry = {"kernel": "bi_core.kernels.norm:_rms_norm_kernel",
             "sources": dict(compile_manifest.kernel_sources("bi_core.kernels.norm"))}
    assert compile_manifest.changed_sources(entry) == []
    entry["sources"]["bi_core/kernels/common.py"] = "0" * 16  # negative control
    assert compile_manifest.changed_sources(entry) == ["bi_core/kernels/common.py"]
    assert compile_manifest.changed_sources({"kernel": "bi_core.kernels.norm:k"}) == []  # recorded without


def test_a_start_skips_the_entries_whose_kernel_files_changed(start_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=compile_ahead.__name__)
    fresh = {"kernel": "bi_core.kernels.norm:_rms_norm_kernel",
             "sources": compile_manifest.kernel_sources("bi_core.kernels.norm")}
    stale = {"kernel": "bi_core.kernels.topk:_softmax_topk_kernel", "sources": {"bi_core/kernels/topk.py": "0" * 16}}
    path = tmp_path / "m.json"
    compile_manifest.write_manifest(path, start_env.fields, [fresh, stale, {"kernel": "fla.x:k", "sources": {}}])
    start_env.start(path)
    assert start_env.launched == [[fresh, {"kernel": "fla.x:k", "sources": {}}]] and start_env.skipped == [1]
    assert "1 of 3 entries" in caplog.records[0].message and "bi_core/kernels/topk.py" in caplog.records[0].message


def test_the_shipped_manifests_match_the_kernel_files():
    """Every shipped compile manifest was recorded from the kernel files in this tree: after editing
    a kernel file, re-record the manifests that compile from it on the GPU (dev/notebook.md says
    how), or a start compiles those kernels lazily again. Negative control: a changed hash shows."""
    from bi_core.backends.cuda_common import COMPILE_MANIFESTS

    paths = sorted(COMPILE_MANIFESTS.glob("*.json"))
    assert paths
    for path in paths:
        entries = json.loads(path.read_text())["entries"]
        assert all("sources" in e for e in entries), path.name
        changes = {e["kernel"]: compile_manifest.changed_sources(e) for e in entries}
        stale = {kernel: files for kernel, files in changes.items() if files}
        assert not stale, f"{path.name}: recorded from other kernel files: {stale}"
    entry = next(e for e in entries if e["sources"])
    tampered = {**entry, "sources": {k: "0" * 16 for k in entry["sources"]}}
    assert compile_manifest.changed_sources(tampered)
