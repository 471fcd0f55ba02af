"""``/v1/responses`` with ``stream: true``: the chat answer's stream, as OpenAI's Responses events
(the names and fields the openai SDK parses, each with its ``sequence_number``).

``response.created`` and ``response.in_progress``; then per output item ``response.output_item.added``
and ``.done`` around its content: a reasoning item's ``response.content_part.added`` (a
``reasoning_text`` part), ``response.reasoning_text.delta`` / ``.done``, ``response.content_part.done``;
the message's the same with an ``output_text`` part and ``response.output_text.delta`` / ``.done``; a
function call's ``response.function_call_arguments.delta`` / ``.done`` (its arguments in one delta:
the parser settles a call when its ``</tool_call>`` arrives). Last ``response.completed``, or
``response.incomplete`` when the answer was cut by ``max_output_tokens``, with the whole response:
the one a non-streamed request gets (``whole_response``: the same events over the whole text). An
engine failure is an ``error`` event. Items are in the order the answer wrote them; the reasoning
item closes when the text or a call begins, the message at the end (text after a call joins it)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import attrs
from fastapi.responses import StreamingResponse

from bi_core.serve.api_errors import output_failure
from bi_core.serve.chat_output import parse_all
from bi_core.serve.response_items import (
    ResponseHead,
    call_item,
    message_item,
    reasoning_item,
    reasoning_part,
    text_part,
    usage,
)

if TYPE_CHECKING:
    import asyncio

    from bi_core.serve.chat import ChatTurn
    from bi_core.serve.chat_output import Parsed
    from bi_core.serve.server import Choice, Server


@attrs.define
class _TextItem:
    """An open reasoning or message item: where it is in the output and its text so far."""

    index: int
    item: dict
    text: str = ""


@attrs.define
class ResponseEvents:
    """One response's events as its parsed pieces arrive; ``output``: its items so far."""

    head: ResponseHead
    output: list[dict] = attrs.Factory(list)
    _seq: int = 0
    _reasoning: _TextItem | None = None
    _message: _TextItem | None = None

    def event(self, kind: str, **fields) -> dict:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return body

    def start(self) -> list[dict]:
        body = self.head.body("in_progress", [], None)
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def feed(self, parsed: Parsed) -> list[dict]:
        """The events for one step of the parsed answer, in its order: reasoning, then text and calls
        (``content_at``: the calls before the text)."""
        out: list[dict] = []
        if parsed.reasoning:
            if self._reasoning is None:
                self._reasoning = self._open(reasoning_item(None, "in_progress"), reasoning_part(""), out)
            out.append(self._delta("response.reasoning_text.delta", self._reasoning, parsed.reasoning))
        if parsed.content or parsed.calls:
            out += self._close_reasoning("completed")
        first = parsed.content_at if parsed.content else len(parsed.calls)
        for call in parsed.calls[:first]:
            out += self._call(call.id, call.name, call.arguments)
        if parsed.content:
            if self._message is None:
                self._message = self._open(message_item(None, "in_progress"), text_part(""), out)
            out.append(self._delta("response.output_text.delta", self._message, parsed.content, logprobs=[]))
        for call in parsed.calls[first:]:
            out += self._call(call.id, call.name, call.arguments)
        return out

    def finish(self, choice: Choice) -> list[dict]:
        """The closing events: open items done, then the whole response."""
        cut = choice.output.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        out = self._close_reasoning(status)
        if (m := self._message) is not None:
            item = message_item(m.text, status, m.item["id"])
            out += [self.event("response.output_text.done", **self._where(m), text=m.text, logprobs=[]),
                    self.event("response.content_part.done", **self._where(m), part=text_part(m.text)),
                    self._item_done(m.index, item)]
            self._message = None
        body = self.head.body(status, list(self.output), usage(choice))
        out.append(self.event(f"response.{status}", response=body))
        return out

    def _open(self, item: dict, part: dict, out: list[dict]) -> _TextItem:
        open_ = _TextItem(len(self.output), item)
        self.output.append(item)
        out += [self.event("response.output_item.added", output_index=open_.index, item=item),
                self.event("response.content_part.added", **self._where(open_), part=part)]
        return open_

    def _delta(self, kind: str, at: _TextItem, text: str, **extra) -> dict:
        at.text += text
        return self.event(kind, **self._where(at), delta=text, **extra)

    def _close_reasoning(self, status: str) -> list[dict]:
        if (r := self._reasoning) is None:
            return []
        self._reasoning = None
        item = reasoning_item(r.text, status, r.item["id"])
        return [self.event("response.reasoning_text.done", **self._where(r), text=r.text),
                self.event("response.content_part.done", **self._where(r), part=reasoning_part(r.text)),
                self._item_done(r.index, item)]

    def _call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        index = len(self.output)
        added = call_item(call_id, name, "", "in_progress")
        self.output.append(added)
        where = {"item_id": added["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.function_call_arguments.delta", **where, delta=arguments),
                self.event("response.function_call_arguments.done", **where, arguments=arguments),
                self._item_done(index, call_item(call_id, name, arguments, "completed", added["id"]))]

    def _item_done(self, index: int, item: dict) -> dict:
        self.output[index] = item
        return self.event("response.output_item.done", output_index=index, item=item)

    @staticmethod
    def _where(at: _TextItem) -> dict:
        return {"item_id": at.item["id"], "output_index": at.index, "content_index": 0}


def whole_response(turn: ChatTurn, head: ResponseHead, choice: Choice) -> dict:
    """A finished answer's response: the one its stream ends with, however the text was cut."""
    events = ResponseEvents(head)
    events.feed(parse_all(turn.parser(), choice.output.text or ""))
    return events.finish(choice)[-1]["response"]


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def stream_response(server: Server, queue: asyncio.Queue, choices: list[Choice], turn: ChatTurn,
                    head: ResponseHead) -> StreamingResponse:
    """The started request's events as server-sent events."""
    events, parser = ResponseEvents(head), turn.parser()
    (c,) = choices

    async def body():
        try:
            for e in events.start():
                yield _sse(e)
            while c.output is None:
                _, delta = await queue.get()
                if delta.finished:
                    c.output = delta.output
                    if (failure := output_failure(c.output, server.shutting_down)) is not None:
                        err = failure.body["error"]
                        yield _sse(events.event("error", code=err["type"], message=err["message"], param=None))
                        return
                for e in events.feed(parser.feed(delta.text, final=delta.finished)):
                    yield _sse(e)
            for e in events.finish(c):
                yield _sse(e)
        finally:  # the client went away (or we are done): an unfinished request stops at the next step
            server.untrack([head.id])
            server.abort(choices)

    return StreamingResponse(body(), media_type="text/event-stream")
