"""``engine.collective_rpc`` (vLLM's): a method of every tensor-parallel rank's worker, called by name,
one result per rank in rank order. At TP=1: the built-ins, an extension class from this module
(``parallel.worker_extension_cls``), refusals naming the method (unknown, private, an attribute),
a method that raises, a timeout, bad class paths. At TP=2 (two processes over gloo): each rank's
answer in rank order, a weight update seen landing on both ranks, a method using the ranks'
collectives, and failures on one rank that leave the lock-step working."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, RequestError, SamplingParams, build_engine
from bi_core.errors import CollectiveRpcError

EXT = f"{__name__}:Probe"  # this module, as the ranks' processes import it (pytest puts tests/rl on sys.path)


class Probe:
    """An extension: its methods run with ``self`` the rank's worker."""

    def whoami(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device)}

    def echo(self, *args, **kwargs) -> dict:
        return {"rank": self.rank, "args": list(args), "kwargs": kwargs}

    def fail_on(self, rank: int) -> str:
        if self.rank == rank:
            raise ValueError(f"refused on rank {rank}")
        return "ok"

    def nap(self, seconds: float, rank: int | None = None) -> int:
        if rank is None or rank == self.rank:
            time.sleep(seconds)
        return self.rank

    def num_weights(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def sum_of_ranks(self) -> int:
        """Every rank runs its method at once: a collective over the ranks works."""
        from bi_core.parallel import state

        t = torch.tensor([self.rank])
        if self.world_size > 1:
            dist.all_reduce(t, group=state.current().device_group)
        return int(t)

    def closure(self):
        return lambda: self.rank  # cannot be pickled: only rank 0's reaches the caller

    def _secret(self) -> str:
        return "private"


def config(tp: int = 1, ext: str | None = EXT) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(parallel={"tensor_parallel_size": tp, "worker_extension_cls": ext}))


@pytest.fixture(scope="module")
def eng():
    return build_engine(config())


def test_built_ins_report_this_ranks_device_weights_and_version(eng):
    assert eng.collective_rpc("report_device_id") == ["cpu"]
    want = sum(p.detach().double().sum().item() for p in eng.model.parameters())
    (before,) = eng.collective_rpc("weight_checksum")
    assert before == pytest.approx(want, rel=1e-12)
    version = eng.weight_version
    norm = eng.model.norm.weight
    old = norm.detach().double().sum().item()
    eng.update_weights({"model.norm.weight": torch.full_like(norm, 2.0)}, version=version + 5)
    assert eng.collective_rpc("weight_version") == [version + 5]
    assert eng.collective_rpc("weight_checksum")[0] == pytest.approx(before - old + 2.0 * norm.numel(), rel=1e-12)


def test_extension_methods_get_the_worker_and_the_arguments(eng):
    assert eng.collective_rpc("whoami") == [{"rank": 0, "world_size": 1, "device": "cpu"}]
    assert eng.collective_rpc("echo", ("a", 2), {"k": "v"}) == [{"rank": 0, "args": ["a", 2], "kwargs": {"k": "v"}}]
    assert eng.collective_rpc("echo", args=["x"], timeout=30) == [{"rank": 0, "args": ["x"], "kwargs": {}}]


@pytest.mark.parametrize("method,why", [("nope", "the worker has no method 'nope'; its methods: closure, echo, "),
                                        ("_secret", "'_secret' is private"), ("__init__", "'__init__' is private"),
                                        ("model", "the worker has no method 'model'"),
                                        ("rank", "the worker has no method 'rank'"),
                                        ("", "method must be a method's name")])
def test_unknown_private_and_non_method_names_are_refused_naming_them(eng, method, why):
    with pytest.raises(RequestError, match=f"^collective_rpc: {why}"):
        eng.collective_rpc(method)


@pytest.mark.parametrize("kw,why", [({"timeout": 0}, "timeout must be a positive"), ({"timeout": True}, "timeout"),
                                    ({"args": "ab"}, "args must be a list"), ({"kwargs": {1: 2}}, "kwargs must be")])
def test_bad_arguments_are_refused(eng, kw, why):
    with pytest.raises(RequestError, match=why):
        eng.collective_rpc("echo", **kw)


def test_a_method_that_raises_is_one_error_naming_the_rank_and_the_exception(eng):
    with pytest.raises(CollectiveRpcError, match=r"^collective_rpc: 'fail_on' failed on 1 of 1 tensor-parallel "
                                                 r"rank\(s\): rank 0: ValueError: refused on rank 0$"):
        eng.collective_rpc("fail_on", (0,))
    with pytest.raises(CollectiveRpcError, match=r"rank 0: TypeError: .*whoami\(\) takes 1 positional argument"):
        eng.collective_rpc("whoami", ("unexpected",))
    assert eng.collective_rpc("fail_on", (1,)) == ["ok"]
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_a_call_longer_than_its_timeout_is_an_error(eng):
    with pytest.raises(CollectiveRpcError, match=r"^collective_rpc: 'nap' timed out: .*timeout 0.05 s "
                                                 r"\(slowest: rank 0, .*its results were dropped"):
        eng.collective_rpc("nap", (0.2,), timeout=0.05)
    assert eng.collective_rpc("nap", (0.0,), timeout=30) == [0]


def test_weight_checksum_refuses_while_the_weights_sleep():
    e = build_engine(config(ext=None))
    e.sleep(2)
    with pytest.raises(CollectiveRpcError, match="rank 0: RequestError: weight_checksum: the engine's kv_cache and "
                                                 "weights are asleep"):
        e.collective_rpc("weight_checksum")
    e.wake_up()
    assert isinstance(e.collective_rpc("weight_checksum")[0], float)


class Clash:
    def weight_version(self) -> int:
        return -1


class Shadow:
    rank = 3


NOT_A_CLASS = 3


@pytest.mark.parametrize("path,why", [
    ("no_such_module_xyz:Probe", "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:Missing", f"module '{__name__}' has no attribute 'Missing'"),
    (f"{__name__}.NOT_A_CLASS", rf"'{__name__}.NOT_A_CLASS' is not a class \(type int\)"),
    (f"{__name__}:Clash", "Clash defines weight_version, which the worker has already"),
    (f"{__name__}:Shadow", "Shadow defines rank, which the worker has already"),
])
def test_a_bad_extension_class_fails_at_build_naming_the_key(path, why):
    with pytest.raises(ConfigError, match=f"^parallel.worker_extension_cls: {why}"):
        build_engine(config(ext=path))


@pytest.mark.parametrize("path", ["Probe", "a:b:c", "mod:", "1mod:Cls", "mod-x:Cls"])
def test_a_malformed_class_path_is_refused_when_the_config_is_read(path):
    with pytest.raises(ConfigError, match=r"^parallel.worker_extension_cls: expected 'module.path:ClassName'"):
        config(ext=path)


def test_tp2_every_rank_answers_in_rank_order_and_failures_keep_the_lockstep():
    eng = build_engine(config(tp=2))
    try:
        assert eng.collective_rpc("whoami") == [{"rank": r, "world_size": 2, "device": "cpu"} for r in (0, 1)]
        assert eng.collective_rpc("echo", ("a",), {"k": "v"}) == [{"rank": r, "args": ["a"], "kwargs": {"k": "v"}}
                                                                  for r in (0, 1)]
        assert eng.collective_rpc("report_device_id") == ["cpu", "cpu"]
        assert eng.collective_rpc("sum_of_ranks") == [1, 1]

        # a weight update seen on every rank: each rank's shards all 0.5 after it
        before, sizes = eng.collective_rpc("weight_checksum"), eng.collective_rpc("num_weights")
        full = {n: torch.full(getattr(p, "full_shape", p.shape), 0.5) for n, p in eng.model.named_parameters()}
        eng.update_weights(full)
        after = eng.collective_rpc("weight_checksum")
        assert after == [0.5 * n for n in sizes] and after != before
        assert eng.collective_rpc("weight_version") == [1, 1]

        with pytest.raises(CollectiveRpcError, match=r"'fail_on' failed on 1 of 2 tensor-parallel rank\(s\): "
                                                     r"rank 1: ValueError: refused on rank 1$"):
            eng.collective_rpc("fail_on", (1,))
        with pytest.raises(CollectiveRpcError, match=r"rank 1: its result \(function\) cannot be sent to rank 0"):
            eng.collective_rpc("closure")
        with pytest.raises(CollectiveRpcError, match=r"'nap' timed out: .*\(slowest: rank 1, "):
            eng.collective_rpc("nap", (0.5,), {"rank": 1}, timeout=0.1)
        with pytest.raises(RequestError, match="cannot be sent to the other tensor-parallel ranks"):
            eng.collective_rpc("echo", (lambda: 0,))
        assert eng.collective_rpc("nap", (0.0,)) == [0, 1]  # the lock-step went on: every rank still answers
        out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        eng.close()
