"""Weights shared by handle (SGLang's ``update_weights_from_tensor``): a trainer process (spawned,
an OS process of its own) serializes a second model's tensors with
``bi_core.rl.serialize_named_tensors``; the payload holds handles (shared-memory names on the
CPU, CUDA IPC on a GPU), not the bytes. After the engine takes it, its outputs equal, bitwise, an
engine built from those weights. A refused payload (unknown name, another load format, not a
payload at all) changes nothing."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from helpers import tiny_config

from bi_core import CheckpointError, EngineConfig, RequestError, SamplingParams, build_engine
from bi_core.rl import serialize_named_tensors

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 60))]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)


def _config(seed: int) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-dense", "seed": seed}}))


def _run(engine) -> list:
    return [(o.token_ids, o.token_logprobs) for o in engine.generate(PROMPTS, PARAMS)]


def sharer_main(conn, case: str) -> None:
    """The trainer: the seed-1 model's weights (engine names), shared; it holds them until told."""
    weights = [(n, p.detach().clone()) for n, p in build_engine(_config(1)).model.named_parameters()]
    if case == "bad_name":
        weights = weights[:3] + [("model.layers.0.mlp.nonsense.weight", weights[0][1])]
    conn.send((serialize_named_tensors(weights), sum(t.numel() * t.element_size() for _, t in weights)))
    conn.recv()  # the engine is done with the handles


def _shared(case: str):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=sharer_main, args=(theirs, case), daemon=True)
    proc.start()
    assert mine.poll(120), "the trainer process sent nothing"
    return proc, mine, *mine.recv()


def _release(proc, conn) -> None:
    conn.send("done")
    proc.join(30)


def test_shared_weights_land_bitwise_and_the_payload_holds_handles_not_bytes():
    engine = build_engine(_config(0))
    before = _run(engine)
    proc, conn, payload, nbytes = _shared("good")
    try:
        count = engine.update_weights_from_tensor([payload], weight_version=7)
    finally:
        _release(proc, conn)
    assert count == len(list(engine.model.parameters()))
    assert len(payload) < nbytes / 20  # names and handles: the 1 MiB of weights stayed where they were
    after = _run(engine)
    assert after == _run(build_engine(_config(1))) and after != before
    assert engine.weight_version == 7


def test_a_refused_payload_changes_nothing():
    engine = build_engine(_config(0))
    before = _run(engine)
    proc, conn, payload, _ = _shared("bad_name")
    try:
        with pytest.raises(CheckpointError, match="unknown weight names .'model.layers.0.mlp.nonsense.weight'"):
            engine.update_weights_from_tensor([payload])
        with pytest.raises(RequestError, match="load_format 'flattened_bucket' is not supported"):
            engine.update_weights_from_tensor([payload], load_format="flattened_bucket")
        with pytest.raises(RequestError, match="3 payloads; expected 1 or one per tensor-parallel rank"):
            engine.update_weights_from_tensor([payload] * 3)
    finally:
        _release(proc, conn)
    with pytest.raises(RequestError, match="not base64"):
        engine.update_weights_from_tensor(["not a payload!"])
    with pytest.raises(RequestError, match="not a complete pickle"):
        engine.update_weights_from_tensor([b"\x80\x04garbage"])
    assert _run(engine) == before and engine.weight_version == 0


# ------------------------------------------------------------------ what a payload may not do


class Calls:
    """A pickled call: unpickling it runs ``fn(*args)`` (what a malicious payload does)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(obj, strategy: str = "file_system") -> str:
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy(strategy)
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
    finally:
        tmp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def opened(monkeypatch):
    """Every shared-memory storage the engine opens (none may be, for a refused payload): torch's
    rebuild as the engine's reader calls it (the trainer's pickler must still find torch's own)."""
    import types

    from torch.multiprocessing import reductions

    from bi_core.rl import handles

    calls = []
    spy = types.SimpleNamespace(**vars(reductions))
    spy.rebuild_storage_filename = lambda *a: calls.append(a) or reductions.rebuild_storage_filename(*a)
    monkeypatch.setattr(handles, "reductions", spy)
    return calls


def test_a_payload_that_runs_anything_is_refused_before_any_object_is_built(tmp_path, opened):
    import builtins
    import os
    import subprocess

    import torch

    from bi_core.rl.tensors import deserialize_named_tensors

    made = tmp_path / "made"
    shared = torch.ones(4)
    cases = [
        ("posix.system", Calls(os.system, f"touch {made}")),
        ("io.open", [("w", Calls(open, str(made), "w"))]),
        ("builtins.eval", Calls(builtins.eval, f"open({str(made)!r}, 'w')")),
        ("subprocess.Popen", [("w", Calls(subprocess.Popen, ["touch", str(made)]))]),
        # a real tensor first, the call nested deeper: refused before the tensor is opened
        ("posix.system", [("model.norm.weight", shared), ("x", [Calls(os.system, f"touch {made}")])]),
    ]
    for name, obj in cases:
        with pytest.raises(RequestError, match=f"names the global {name}, which is not one of"):
            deserialize_named_tensors(_payload(obj))
    assert not made.exists() and opened == []
    # the same tensor alone opens (the fixture sees it): the refusals above were the globals'
    assert torch.equal(deserialize_named_tensors(_payload([("w", shared)]))[0][1], shared) and len(opened) == 1


def test_opcodes_and_reducers_a_tensor_payload_never_needs_are_refused(opened):
    import base64

    import torch

    from bi_core.rl.tensors import deserialize_named_tensors

    # BUILD on an allowed class would set attributes on it (here from a tuple's items)
    build = b"\x80\x02ctorch\nSize\nN)\x86b."
    with pytest.raises(RequestError, match="opcode BUILD"):
        deserialize_named_tensors(base64.b64encode(build).decode())
    # the file-descriptor strategy: its DupFd connects to an address the payload names
    with pytest.raises(RequestError, match="rebuild_storage_fd, .*file-descriptor strategy cannot be opened safely"):
        deserialize_named_tensors(_payload([("w", torch.ones(3))], strategy="file_descriptor"))
    # plain pickle: the tensor's bytes, not a handle
    import pickle

    with pytest.raises(RequestError, match="names the global torch._utils._rebuild_tensor_v2"):
        deserialize_named_tensors(pickle.dumps([("w", torch.ones(3))]))
    assert opened == []


def test_a_rebuild_call_with_forged_arguments_is_refused(opened, tmp_path):
    import torch
    from torch.multiprocessing import reductions

    from bi_core.rl.tensors import deserialize_named_tensors

    storage = torch.ones(4).untyped_storage()
    typed = torch.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)
    too_long = Calls(reductions.rebuild_tensor, torch.Tensor, typed, (0, torch.Size([100]), (1,), False))
    with pytest.raises(RequestError, match=r"size \(100,\), stride \(1,\) at offset 0 reaches past its storage of 4"):
        deserialize_named_tensors(_payload([("w", too_long)]))
    manager = storage._share_filename_cpu_()[0]
    for handle, why in ((b"/../../etc/passwd", "must be a torch shared-memory name"),
                        (b"/torch_1_2_3", "cannot be opened")):
        forged = Calls(reductions.rebuild_storage_filename, torch.UntypedStorage, manager, handle, 16)
        with pytest.raises(RequestError, match=why):
            deserialize_named_tensors(_payload([("w", Calls(reductions.rebuild_tensor, torch.Tensor, Calls(
                reductions.rebuild_typed_storage, forged, torch.float32), (0, torch.Size([4]), (1,), False)))]))
    elsewhere = Calls(reductions.rebuild_storage_filename, torch.UntypedStorage, str(tmp_path).encode(),
                      b"/torch_1_2_3", 4)
    with pytest.raises(RequestError, match="manager must be torch's socket"):
        deserialize_named_tensors(_payload([("w", Calls(reductions.rebuild_typed_storage, elsewhere,
                                                        torch.float32))]))
    # only the genuine storage of the first case was opened (its size is known once open): the forged
    # names passed the form checks, then failed before torch was called
    assert len(opened) == 1


def _cuda_args(counter: bytes, counter_offset: int, device=0, nbytes: int = 64) -> tuple:
    """rebuild_cuda_tensor's 15 arguments, as torch's reducer writes them for a 4x4 float32 tensor."""
    import torch

    return (torch.Tensor, torch.Size([4, 4]), (4, 1), 0, torch.TypedStorage, torch.float32, device, b"h" * 64,
            nbytes, 0, False, counter, counter_offset, b"e" * 64, True)


@pytest.fixture
def ref_counter():
    """A CUDA IPC reference-counter file as torch's producer makes one (10000 int64 slots)."""
    import os

    name = f"/torch_{os.getpid()}_7_7".encode()
    path = b"/dev/shm" + name
    with open(path, "wb") as f:
        f.truncate(8 * 10000)
    yield name
    os.unlink(path)


def test_cuda_handles_are_checked_then_given_to_torchs_rebuild(monkeypatch, ref_counter):
    """No GPU here: torch's rebuild_cuda_tensor is replaced by a recorder, to see that what the
    checks let through reaches it unchanged (SGLang's patched reducer, by name, included) and what
    they refuse never does."""
    import sys
    import types

    import torch
    from torch.multiprocessing import reductions

    from bi_core.rl import handles
    from bi_core.rl.tensors import deserialize_named_tensors

    calls = []
    spy = types.SimpleNamespace(**vars(reductions))
    spy.rebuild_cuda_tensor = lambda *a: calls.append(a) or torch.zeros(4, 4)
    monkeypatch.setattr(handles, "reductions", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    sglang = types.ModuleType("sglang.srt.utils.patch_torch")  # what SGLang's trainers pickle by name

    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("SGLang's function is never called: the engine maps it to its own")

    sglang._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
    _rebuild_cuda_tensor_modified.__module__ = sglang.__name__
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    for parent in ("sglang", "sglang.srt", "sglang.srt.utils"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, sglang.__name__, sglang)

    for fn in (reductions.rebuild_cuda_tensor, _rebuild_cuda_tensor_modified):
        out = deserialize_named_tensors(_payload([("w", Calls(fn, *_cuda_args(ref_counter, 9999)))]))
        assert out[0][0] == "w" and torch.equal(out[0][1], torch.zeros(4, 4))
    assert len(calls) == 2 and calls[0][1:] == _cuda_args(ref_counter, 9999)[1:]
    refused = [
        (_cuda_args(ref_counter, 10000), r"reference counter's slot must be an integer in \[0, 9999\]"),
        (_cuda_args(ref_counter, -1), "reference counter's slot"),
        (_cuda_args(b"/etc/passwd", 0), "reference counter's name must be a torch shared-memory name"),
        (_cuda_args(b"/torch_1_2_3", 0), "cannot be opened"),
        (_cuda_args(ref_counter, 0, nbytes=63), r"reaches past its storage of 63 bytes"),
        (_cuda_args(ref_counter, 0, device=1), "on device 1, which this engine process does not have"),
        (_cuda_args(ref_counter, 0)[:14], "takes 15 arguments, got 14"),
    ]
    for args, why in refused:
        with pytest.raises(RequestError, match=why):
            deserialize_named_tensors(_payload([("w", Calls(reductions.rebuild_cuda_tensor, *args))]))
    assert len(calls) == 2
