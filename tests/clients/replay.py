"""Sending a recorded body as its client does, and reading the answer as its client reads it."""

from __future__ import annotations

import json

import httpx


def send(server, request: tuple[str, str, dict | None], **overrides) -> httpx.Response:
    """One recorded ``(method, path, body)`` request; ``overrides`` change body fields."""
    method, path, body = request
    body = {**body, **overrides} if body is not None else None
    return httpx.request(method, f"{server.url}{path}", json=body, timeout=120)


def events(server, request: tuple[str, str, dict], **overrides) -> tuple[httpx.Response, list]:
    """A streamed request's response and its server-sent events (``[DONE]`` as the string)."""
    method, path, body = request
    out = []
    with httpx.stream(method, f"{server.url}{path}", json={**body, **overrides}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = line.removeprefix("data:").strip()
                out.append(data if data == "[DONE]" else json.loads(data))
    return r, out
