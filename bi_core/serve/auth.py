"""Who may call which route: SGLang's two keys and its two levels, plus a rule for servers that
listen beyond loopback.

- ``/health*``, ``/ping`` and ``/metrics`` answer anyone (probes and scrapers carry no secret), as
  SGLang's (``/ping``: vLLM's and SageMaker's health probe, outside vLLM's ``/v1`` key check).
- The control routes (``CONTROL_PATHS``: weight updates, sleep and wake, pause and resume, aborts,
  cache resets, weight-update groups, ``/collective_rpc``) need ``serve.admin_api_key`` when it is
  set (``serve.api_key`` is then not enough), else ``serve.api_key`` when that is set: SGLang's
  ``ADMIN_OPTIONAL`` level.
- Every other route needs ``serve.api_key`` when it is set.
- With neither key, the control routes answer only a server bound to loopback (127.0.0.0/8, ::1,
  localhost): one that listens beyond it answers them 403, saying how to enable them, unless
  ``serve.allow_unauthenticated_control: true`` (then a warning at start). A control route can
  replace the weights, read files the server can read (a disk update) and stop generation.

A key travels as ``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235), the
key compared in constant time. The scale-out front (``bi_core.scale.front``) applies the same
``Guard``."""

from __future__ import annotations

import ipaddress
import secrets

import attrs

from bi_core.serve.api_errors import ApiError

OPEN_PATHS = ("/health", "/ping", "/metrics")  # prefixes, as SGLang's (/health_generate too)
CONTROL_PATHS = frozenset({
    "/pause", "/resume", "/abort_requests", "/reset_prefix_cache", "/sleep", "/wake_up",
    "/init_weight_transfer_engine", "/update_weights", "/pause_generation", "/continue_generation", "/abort_request",
    "/flush_cache", "/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/destroy_weights_update_group", "/update_weights_from_disk", "/release_memory_occupation",
    "/resume_memory_occupation", "/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors",
})
ENABLE_HINT = ("set serve.admin_api_key (or serve.api_key; --api-key) and send 'Authorization: Bearer <key>', or "
               "set serve.allow_unauthenticated_control: true to let anyone who reaches the port call them")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (serve.host) binds loopback only: 127.0.0.0/8, ::1 or localhost. Anything
    else (0.0.0.0, ::, a name, a routable address) is taken to be reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of ``Authorization: Bearer <token>`` (the scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _matches(authorization: str | None, key: str) -> bool:
    token = bearer_token(authorization)
    return token is not None and secrets.compare_digest(token.encode(), key.encode())


def unauthorized(which: str) -> ApiError:
    return ApiError(401, f"invalid or missing {which} (Authorization: Bearer <key>)", "authentication_error",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


@attrs.frozen
class Guard:
    """The keys and whether control is open without one; ``check`` answers one request."""

    host: str
    api_key: str | None = None
    admin_api_key: str | None = None
    allow_unauthenticated_control: bool = False

    @classmethod
    def of(cls, serve, host: str | None = None) -> Guard:
        """From a ServeConfig (``host``: where this app listens, default serve.host)."""
        return cls(host if host is not None else serve.host, serve.api_key, serve.admin_api_key,
                   serve.allow_unauthenticated_control)

    @property
    def control_refused(self) -> bool:
        """No key, beyond loopback, not allowed: every control route answers 403."""
        return (self.api_key is None and self.admin_api_key is None and not self.allow_unauthenticated_control
                and not is_loopback(self.host))

    @property
    def control_unguarded(self) -> bool:
        """Control open to anyone who reaches the port beyond loopback (allowed explicitly)."""
        return (self.api_key is None and self.admin_api_key is None and self.allow_unauthenticated_control
                and not is_loopback(self.host))

    def check(self, path: str, authorization: str | None) -> ApiError | None:
        """None: let the request through; else the error it gets."""
        if path.startswith(OPEN_PATHS):
            return None
        if path in CONTROL_PATHS:
            if self.admin_api_key is not None:
                return None if _matches(authorization, self.admin_api_key) else unauthorized("admin API key")
            if self.api_key is None and self.control_refused:
                return ApiError(403, f"{path} is a control route, and this server listens on {self.host} (beyond "
                                     f"loopback) without an API key, so its control routes are off: {ENABLE_HINT}",
                                "permission_error", code="control_routes_disabled")
        if self.api_key is not None and not _matches(authorization, self.api_key):
            return unauthorized("API key")
        return None
