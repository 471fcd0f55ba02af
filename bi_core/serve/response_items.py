"""The Responses API's shapes that both a whole answer and its stream of events use: the
``response`` object (``ResponseHead.body``), its output items (reasoning, message,
function_call) and its usage."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from bi_core.serve.server import Choice


@attrs.frozen
class ResponseHead:
    """What a response says beside its output: the request's settings, its id and creation time."""

    settings: dict  # the request's settings a response echoes (``responses.echoed_settings``)
    id: str
    model: str | None
    created_at: int

    def body(self, status: str, output: list[dict], usage: dict | None) -> dict:
        """The ``response`` object at ``status`` (in_progress, completed, incomplete)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "output": output, **self.settings, "previous_response_id": None, "store": False,
                "truncation": "disabled", "usage": usage}


def usage(c: Choice) -> dict:
    """A finished choice's usage, as the Responses API counts it."""
    n = len(c.output.token_ids)
    return {"input_tokens": c.prompt_tokens, "output_tokens": n, "total_tokens": c.prompt_tokens + n,
            "input_tokens_details": {"cached_tokens": c.output.num_cached_tokens}}


def reasoning_item(text: str | None, status: str, item_id: str | None = None) -> dict:
    """A reasoning item; ``text`` None: no content part yet (a stream's item when it opens)."""
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [] if text is None else [reasoning_part(text)], "status": status}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def message_item(text: str | None, status: str, item_id: str | None = None) -> dict:
    """The assistant's message; ``text`` None: no content part yet (a stream's item when it opens)."""
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
