"""A control call made to every replica at once, and the one answer made of theirs.

Each replica gets the call as it came (method, query string, body, ``Authorization``), or a body
of its own (a weight-update group: each replica's ``rank_offset``); all run together, since a
weight sync needs every replica in its collectives at once. The answer: ``success`` (every
replica answered 2xx), ``message``, ``replicas`` (per replica: index, URL, status code, body or
the error that kept it from answering), ``skipped`` (replicas that were not up: restarting,
failed), and every field whose value all replicas' bodies share (``"status": "paused"``,
``"is_paused": true``, ``"weight_version": 3``), so a client written for one server reads it
unchanged. Its status: 200 when every replica succeeded, the replicas' status when they all
answered the same one, else 502; a failure also carries OpenAI's ``error`` object (the replicas'
own when they all gave the same one)."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import httpx

from bi_core.serve import formats

OWN_FIELDS = ("success", "message", "replicas", "skipped")


@attrs.frozen
class Answer:
    replica: int
    url: str
    status_code: int | None  # None: no answer (unreachable, connection cut)
    body: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    def to_json(self) -> dict:
        out = {"replica": self.replica, "url": self.url, "status_code": self.status_code, "body": self.body}
        return {**out, "error": self.error} if self.error is not None else out


def _body(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


async def call_all(client: httpx.AsyncClient, targets: list[tuple[int, str]], method: str, path: str, query: str,
                   headers: dict[str, str], bodies: list[bytes | None]) -> list[Answer]:
    """``method path?query`` on every ``(index, url)`` target together, target i with ``bodies[i]``."""

    async def one(index: int, url: str, body: bytes | None) -> Answer:
        try:
            r = await client.request(method, f"{url}{path}" + (f"?{query}" if query else ""), content=body,
                                     headers=headers)
        except httpx.HTTPError as e:
            return Answer(index, url, None, error=f"{type(e).__name__}: {e}")
        return Answer(index, url, r.status_code, _body(r))

    return list(await asyncio.gather(*(one(i, u, b) for (i, u), b in zip(targets, bodies))))


def merge(path: str, answers: list[Answer], skipped: list[dict]) -> tuple[int, dict]:
    """The status and body of the whole call (see the module's docstring)."""
    ok = [a for a in answers if a.ok]
    success = bool(answers) and len(ok) == len(answers)
    if not answers:
        message = f"{path}: no replica is up to take it"
    elif success:
        message = f"{path}: done on all {len(answers)} replicas"
    else:
        failed = ", ".join(f"{a.replica} ({a.status_code or a.error})" for a in answers if not a.ok)
        message = f"{path}: {len(ok)} of {len(answers)} replicas succeeded; failed: {failed}"
    body: dict = {"success": success, "message": message, "replicas": [a.to_json() for a in answers],
                  "skipped": skipped}
    dicts = [a.body for a in answers]
    if dicts and all(isinstance(d, dict) for d in dicts):
        for key, value in dicts[0].items():
            if key not in OWN_FIELDS and all(key in d and d[key] == value for d in dicts[1:]):
                body[key] = value
    codes = {a.status_code for a in answers}
    if success:
        status = 200
    elif len(codes) == 1 and None not in codes:
        status = codes.pop()
    else:
        status = 502
    if not success and not isinstance(body.get("error"), dict):  # OpenAI's error object, as a lone server's
        body["error"] = formats.error_body(message, "server_error" if status >= 500 else "invalid_request_error",
                                           code="replicas_failed")["error"]
    return status, body
