"""Opening an ``update_weights_from_tensor`` payload without a general unpickler.

The payload is a pickle (SGLang's ``MultiprocessingSerializer``: ``ForkingPickler`` with torch's
reducers), and a pickle can name any callable to run while it loads: ``os.system``, ``open``,
``eval``. Nothing a request carries may do that, so the payload is read by ``HandleUnpickler``,
which knows exactly what torch's reducers emit for a tensor shared by handle and nothing else:

- CPU tensors shared through shared-memory files (the ``file_system`` strategy, what
  ``serialize_named_tensors`` uses): ``rebuild_tensor(Tensor, rebuild_typed_storage(
  rebuild_storage_filename(UntypedStorage, manager, name, size), dtype), metadata)``;
- CUDA tensors shared by CUDA IPC: ``rebuild_cuda_tensor(...)``, or SGLang's patched
  ``_rebuild_cuda_tensor_modified`` (the same arguments, the device as its UUID), which maps to
  the same checked function here (SGLang's module is never imported);
- ``torch.Size`` and dtypes (``torch.float32``, ...).

Each of those globals maps to a function of this module that checks every argument (types,
ranges, that a shared-memory name has torch's form and names a file of this user at least as
large as claimed, that a CUDA IPC reference-counter slot is inside its file) before it calls
torch's own rebuild. Classes (``torch.Tensor``, the storage classes) come back as inert tokens
that cannot be called. The file-descriptor strategy (``rebuild_storage_fd``: a ``DupFd`` that
connects to an address the payload names to receive a descriptor) is refused: it cannot be
made safe, and a trainer process is no child of the engine's, so it could not work anyway.

Loading runs twice: first with placeholders (every opcode and every global checked, every
argument's form checked, nothing opened), then for real. Any other global, or an opcode a list
of (name, tensor) pairs never needs (``BUILD``, ``NEWOBJ``, ``INST``, persistent ids, ...), is
a RequestError naming it before any object is built.

What stays unchecked: a CUDA IPC handle's claimed storage size against the allocation it names
(only the driver knows it); a lying size makes the engine read past the trainer's allocation,
which can fault the engine's CUDA context, not run code."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import stat
from collections.abc import Callable

import attrs
import torch
from torch.multiprocessing import reductions

from bi_core.errors import RequestError

WHAT = "update_weights_from_tensor"
SHM_DIR = "/dev/shm"  # where POSIX shared memory (shm_open) names live on Linux
SHM_NAME = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")  # libshm's NewProcessWideShmHandle
MANAGER_SOCKET = re.compile(rb"/[^\x00]*/torch-shm-dir-[A-Za-z0-9_]+/manager\.sock")
REF_COUNTER_SLOTS = 10000  # torch/csrc/CudaIPCTypes.h: CUDA_IPC_REF_COUNTER_FILE_SIZE (int64 slots)
MAX_BYTES = 1 << 48
# what a list of (str, tensor handle) pairs needs, in every protocol ForkingPickler may write
OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET", "UNICODE",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "INT", "BININT",
    "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "NONE", "NEWTRUE", "NEWFALSE", "GLOBAL", "STACK_GLOBAL", "REDUCE",
})


@attrs.frozen
class Token:
    """A class the payload names (it is only ever passed to a rebuild function, never called)."""

    name: str


TENSOR, PARAMETER = Token("torch.Tensor"), Token("torch.nn.parameter.Parameter")
UNTYPED, TYPED = Token("torch.UntypedStorage"), Token("torch.TypedStorage")


@attrs.frozen
class Placeholder:
    """What the checking pass builds in place of a storage or a tensor."""

    kind: str  # untyped, typed, tensor


def _refuse(why: str) -> RequestError:
    return RequestError(f"{WHAT}: the payload is refused: {why} (a payload holds (name, tensor) pairs shared by "
                        "handle: bi_core.rl.serialize_named_tensors, or SGLang's MultiprocessingSerializer)")


def _int(value, what: str, low: int = 0, high: int = MAX_BYTES) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _shape(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64:
        raise _refuse(f"{what} must be a tuple of at most 64 integers, got {type(value).__name__}")
    return tuple(_int(v, what) for v in value)


def _kind(obj) -> str | None:
    if isinstance(obj, Placeholder):
        return obj.kind
    if isinstance(obj, torch.UntypedStorage):
        return "untyped"
    if isinstance(obj, torch.TypedStorage):
        return "typed"
    return "tensor" if isinstance(obj, torch.Tensor) else None


def _extent(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements from the storage's start that the view reaches (0 for an empty view)."""
    if len(size) != len(stride):
        raise _refuse(f"a tensor's size {size} and stride {stride} differ in length")
    if 0 in size:
        return 0
    return offset + 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _own_file(path: bytes, what: str, *, socket: bool = False, min_size: int = 0) -> None:
    """``path`` exists, belongs to this process's user, is a socket (or a regular file of at least
    ``min_size`` bytes): a name the payload gives never reaches another user's file."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise _refuse(f"{what} {path!r} cannot be opened ({e.strerror}); is the trainer process still holding its "
                      "tensors?") from None
    ok = stat.S_ISSOCK(st.st_mode) if socket else stat.S_ISREG(st.st_mode) and st.st_size >= min_size
    if not ok or st.st_uid != os.geteuid():
        raise _refuse(f"{what} {path!r} is not a {'socket' if socket else 'shared-memory file'} of this user"
                      + ("" if socket else f" holding {min_size} bytes"))


def _shm_name(value, what: str) -> bytes:
    if not isinstance(value, bytes) or not SHM_NAME.fullmatch(value):
        raise _refuse(f"{what} must be a torch shared-memory name (b'/torch_<pid>_<n>_<n>'), got {value!r:.80}")
    return value


class Rebuild:
    """The rebuild functions a payload may call: each checks its arguments, then (``real``) calls
    torch's; otherwise it returns a Placeholder."""

    def __init__(self, real: bool) -> None:
        self.real = real

    def storage_filename(self, cls, manager, handle, size, dtype=None):
        if cls is not UNTYPED or dtype is not None:
            raise _refuse(f"rebuild_storage_filename of {cls!r} (dtype {dtype!r}): only untyped storages are shared")
        if not isinstance(manager, bytes) or not MANAGER_SOCKET.fullmatch(manager):
            raise _refuse(f"the shared-memory manager must be torch's socket (.../torch-shm-dir-*/manager.sock), got "
                          f"{manager!r:.80}")
        _shm_name(handle, "a CPU storage's shared-memory name")
        size = _int(size, "a CPU storage's size")
        if not self.real:
            return Placeholder("untyped")
        if not os.path.isdir(SHM_DIR):
            raise _refuse(f"CPU tensors are shared through {SHM_DIR}, which this system does not have")
        _own_file(manager, "the shared-memory manager", socket=True)
        _own_file(os.fsencode(SHM_DIR) + handle, "the shared-memory file", min_size=size)
        return reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)

    def typed_storage(self, storage, dtype):
        if _kind(storage) != "untyped" or not isinstance(dtype, torch.dtype):
            raise _refuse(f"rebuild_typed_storage needs an untyped storage and a dtype, got {_kind(storage)} and "
                          f"{dtype!r}")
        return reductions.rebuild_typed_storage(storage, dtype) if self.real else Placeholder("typed")

    def tensor(self, cls, storage, metadata):
        if cls not in (TENSOR, PARAMETER) or _kind(storage) != "typed":
            raise _refuse(f"rebuild_tensor needs a tensor class and a typed storage, got {cls!r} and {_kind(storage)}")
        if not isinstance(metadata, tuple) or len(metadata) != 4 or not isinstance(metadata[3], bool):
            raise _refuse("rebuild_tensor's metadata must be (offset, size, stride, requires_grad)")
        offset, size, stride = _int(metadata[0], "a tensor's offset"), _shape(metadata[1], "a tensor's size"), \
            _shape(metadata[2], "a tensor's stride")
        reach = _extent(size, stride, offset)
        if not self.real:
            return Placeholder("tensor")
        elements = storage._untyped_storage.nbytes() // storage.dtype.itemsize  # .size() warns: TypedStorage is deprecated
        if reach > elements:
            raise _refuse(f"a tensor of size {size}, stride {stride} at offset {offset} reaches past its storage of "
                          f"{elements} elements")
        return reductions.rebuild_tensor(torch.Tensor, storage, (offset, torch.Size(size), stride, False))

    def cuda_tensor(self, *args):
        if len(args) != 15:
            raise _refuse(f"rebuild_cuda_tensor takes 15 arguments, got {len(args)}")
        (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset, grad,
         counter, counter_offset, event, event_sync) = args
        if cls not in (TENSOR, PARAMETER) or storage_cls not in (TYPED, UNTYPED) or not isinstance(dtype, torch.dtype):
            raise _refuse(f"rebuild_cuda_tensor needs a tensor class, a storage class and a dtype, got {cls!r}, "
                          f"{storage_cls!r}, {dtype!r}")
        size, stride = _shape(size, "a tensor's size"), _shape(stride, "a tensor's stride")
        offset, storage_bytes = _int(offset, "a tensor's offset"), _int(storage_bytes, "a storage's size")
        storage_offset = _int(storage_offset, "a storage's offset in its CUDA allocation")
        if _extent(size, stride, offset) * dtype.itemsize > storage_bytes:
            raise _refuse(f"a tensor of size {size}, stride {stride} at offset {offset} reaches past its storage of "
                          f"{storage_bytes} bytes")
        if not all(v is None or isinstance(v, bytes) for v in (handle, event)) \
                or not isinstance(grad, bool) or not isinstance(event_sync, bool):
            raise _refuse("rebuild_cuda_tensor's handles must be bytes and its flags booleans")
        _shm_name(counter, "a CUDA IPC reference counter's name")
        counter_offset = _int(counter_offset, "a CUDA IPC reference counter's slot", 0, REF_COUNTER_SLOTS - 1)
        if isinstance(device, str):  # SGLang's patched reducer sends the device's UUID
            device = _device_by_uuid(device) if self.real else 0
        device = _int(device, "a CUDA device index", 0, 1 << 16)
        if not self.real:
            return Placeholder("tensor")
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise _refuse(f"a CUDA tensor on device {device}, which this engine process does not have")
        _own_file(os.fsencode(SHM_DIR) + counter, "the CUDA IPC reference counter",
                  min_size=8 * REF_COUNTER_SLOTS)
        storage_type = torch.TypedStorage if storage_cls is TYPED else torch.UntypedStorage
        return reductions.rebuild_cuda_tensor(torch.Tensor, torch.Size(size), stride, offset, storage_type, dtype,
                                              device, handle, storage_bytes, storage_offset, False, counter,
                                              counter_offset, event, event_sync)


def _device_by_uuid(uuid: str) -> int:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                return i
    raise _refuse(f"a CUDA tensor on the device with UUID {uuid!r:.60}, which this engine process does not see")


_REDUCTIONS = "torch.multiprocessing.reductions"
_SGLANG_CUDA = ("sglang.srt.patch_torch", "sglang.srt.utils.patch_torch")  # where SGLang's patched reducer lives
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _globals(rebuild: Rebuild) -> dict[tuple[str, str], object]:
    """Every global a payload may name, and what it becomes."""
    found: dict[tuple[str, str], object] = {
        (_REDUCTIONS, "rebuild_storage_filename"): rebuild.storage_filename,
        (_REDUCTIONS, "rebuild_typed_storage"): rebuild.typed_storage,
        (_REDUCTIONS, "rebuild_tensor"): rebuild.tensor,
        (_REDUCTIONS, "rebuild_cuda_tensor"): rebuild.cuda_tensor,
        **{(m, "_rebuild_cuda_tensor_modified"): rebuild.cuda_tensor for m in _SGLANG_CUDA},
        ("torch", "Size"): torch.Size,
        ("torch", "Tensor"): TENSOR, ("torch._tensor", "Tensor"): TENSOR,
        ("torch.nn.parameter", "Parameter"): PARAMETER,
        ("torch", "UntypedStorage"): UNTYPED, ("torch.storage", "UntypedStorage"): UNTYPED,
        ("torch", "TypedStorage"): TYPED, ("torch.storage", "TypedStorage"): TYPED,
    }
    found.update({("torch", name): d for name, d in _DTYPES.items()})
    return found


ALLOWED = frozenset(_globals(Rebuild(real=False)))
_STRINGS = ("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")


def _refused_global(module: str, name: str) -> RequestError:
    why = " (the file-descriptor strategy cannot be opened safely; share with file_system)" \
        if name in ("rebuild_storage_fd", "DupFd") else ""
    return _refuse(f"it names the global {module}.{name}, which is not one of torch's tensor-sharing rebuild "
                   f"functions{why}")


class HandleUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of ``_globals``; any other is refused."""

    def __init__(self, file, rebuild: Rebuild) -> None:
        super().__init__(file)
        self._allowed = _globals(rebuild)

    def find_class(self, module: str, name: str):
        target = self._allowed.get((module, name))
        if target is None:
            raise _refused_global(module, name)
        return target

    def persistent_load(self, pid):
        raise _refuse("it holds a persistent id")


def _check_opcodes(raw: bytes) -> None:
    """Every opcode is one a list of (name, tensor) pairs needs, and every global (named by the
    strings pushed, or fetched from the memo, just before it) is allowed: the first problem in
    the stream is the one reported."""
    strings: list[str | None] = []  # what the last two opcodes pushed (None: not a string)
    memo: dict[int, str | None] = {}
    try:
        for op, arg, pos in pickletools.genops(raw):
            name = op.name
            if name not in OPCODES:
                raise _refuse(f"it holds the pickle opcode {name} at byte {pos}, which (name, tensor) pairs never need")
            if name == "GLOBAL" or (name == "STACK_GLOBAL" and None not in strings[-2:] and len(strings) >= 2):
                module, attr = arg.split(" ", 1) if name == "GLOBAL" else strings[-2:]
                if (module, attr) not in ALLOWED:
                    raise _refused_global(module, attr)
            if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if name == "MEMOIZE" else arg] = strings[-1] if strings else None
                continue
            pushed = arg if name in _STRINGS else memo.get(arg) if name in ("GET", "BINGET", "LONG_BINGET") else None
            strings = [*strings, pushed][-2:]
    except (ValueError, EOFError) as e:  # genops: truncated or not a pickle
        raise _refuse(f"it is not a complete pickle ({e})") from None


def _load(raw: bytes, rebuild: Rebuild):
    try:
        return HandleUnpickler(io.BytesIO(raw), rebuild).load()
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's rebuild failing (a handle whose owner is gone), bad structure
        raise RequestError(f"{WHAT}: the payload's tensors could not be opened ({type(e).__name__}: {e}); is the "
                           "trainer process still holding them?") from None


def open_pairs(raw: bytes) -> list[tuple[str, torch.Tensor]]:
    """The payload's (name, tensor) pairs: checked with placeholders first (nothing opened), then opened."""
    _check_opcodes(raw)
    _pairs(_load(raw, Rebuild(real=False)), lambda t: isinstance(t, Placeholder) and t.kind == "tensor")
    return _pairs(_load(raw, Rebuild(real=True)), lambda t: isinstance(t, torch.Tensor))


def _pairs(obj, is_tensor: Callable[[object], bool]) -> list:
    if not isinstance(obj, list) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                            and is_tensor(p[1]) for p in obj):
        raise RequestError(f"{WHAT}: the payload must hold a list of (name, tensor) pairs "
                           "(bi_core.rl.serialize_named_tensors)")
    return obj
