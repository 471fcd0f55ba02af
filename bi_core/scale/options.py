"""What ``bi-engine serve --data-parallel-size N`` takes beyond the engine's config, checked once:
each bad value is one error naming its flag and what is allowed."""

from __future__ import annotations

import attrs

from bi_core.errors import BiEngineError

# sglang-router's policies that need nothing from the client (its ``manual`` policy routes by a
# header the client must send; its PD-disaggregation policies need prefill/decode workers)
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
SCALE_EXTRA = "pip install 'bi-engine[scale]'"


@attrs.frozen(kw_only=True)
class ScaleOptions:
    """How the replicas are placed, routed to and watched."""

    data_parallel_size: int
    ray_address: str | None = None  # None: RAY_ADDRESS, else a Ray instance started on this machine
    router_policy: str = "cache_aware"
    control_port: int | None = None  # None: serve.port + 1
    router_args: tuple[str, ...] = ()  # more sglang-router flags, passed as they are
    startup_timeout_s: float = 600.0  # a replica's start: engine built, /health answering 200
    poll_interval_s: float = 1.0  # how often every replica's process and /health are checked

    def __attrs_post_init__(self) -> None:
        if self.data_parallel_size < 2:
            raise BiEngineError(f"--data-parallel-size: replicas behind a router need at least 2, got "
                                f"{self.data_parallel_size} (1 serves without Ray or a router)")
        if self.router_policy not in ROUTER_POLICIES:
            raise BiEngineError(f"--router-policy: expected one of {', '.join(ROUTER_POLICIES)}; got "
                                f"{self.router_policy!r}")
        if self.control_port is not None and not 1 <= self.control_port <= 65535:
            raise BiEngineError(f"--control-port: expected 1..65535, got {self.control_port}")
        taken = {"--host", "--port", "--worker-urls", "--policy", "--api-key"} & set(self.router_args)
        if taken:
            raise BiEngineError(f"--router-args: {', '.join(sorted(taken))} are set by bi-engine serve (use --host, "
                                "--port, --router-policy, --api-key; the worker URLs are the replicas')")


def check_installed() -> None:
    """Ray and sglang-router import, else one error naming the extra that brings them."""
    missing = []
    for module, package in (("ray", "ray"), ("sglang_router", "sglang-router")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise BiEngineError(f"parallel.data_parallel_size > 1 (--data-parallel-size) needs {' and '.join(missing)}, "
                            f"which are not installed: {SCALE_EXTRA}")
