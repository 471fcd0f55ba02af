"""A chat answer's text split into reasoning, content and tool calls, as it streams: Qwen3.5's
format (the reasoning parser vLLM calls ``qwen3``, the tool parser ``qwen3_coder``).

- Reasoning: when the prompt ends inside ``<think>`` (the generation prompt with thinking on), the
  answer is reasoning up to ``</think>``, content after it; a ``<tool_call>`` followed by
  ``<function=`` also ends it (Qwen3.5 sometimes calls a tool without closing its thinking); an
  answer cut before either is all reasoning. An answer that opens with ``<think>`` itself starts
  reasoning there.
- Tool calls (when the request offers tools and ``tool_choice`` is not ``none``): each
  ``<tool_call>...</tool_call>`` block of the content is parsed when its end arrives
  (``tool_call_parser.parse_block``); a block that is not a call, or one cut off by the end of the answer,
  stays content, with the reason logged. Whitespace that only separates content from calls (or calls
  from each other) is dropped.

The parser holds back text that could still turn out to be a tag, so what it has emitted never
changes: the streamed pieces joined are the non-streamed answer (``parse_all``)."""

from __future__ import annotations

import logging

import attrs

from bi_core.models.chat_template import THINK_CLOSE, THINK_OPEN
from bi_core.serve.tool_call_parser import (
    FUNCTION_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MalformedToolCall,
    ToolCall,
    parse_block,
)

log = logging.getLogger(__name__)


@attrs.define
class Parsed:
    """What one step of the text gave: reasoning text, content text, calls completed."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = attrs.Factory(list)
    content_at: int = 0  # how many of the calls came before the content (the Responses API's item order)

    def add_content(self, text: str) -> None:
        if text and not self.content:
            self.content_at = len(self.calls)
        self.content += text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_start(text: str, final: bool) -> tuple[int, int]:
    """Where a tool call begins in reasoning text (``<tool_call>``, then blanks, then ``<function=``)
    and from where text must be held back because one might still begin there; -1 for none."""
    pos = text.find(TOOL_CALL_OPEN)
    while pos >= 0:
        rest = text[pos + len(TOOL_CALL_OPEN):].lstrip()
        if rest.startswith(FUNCTION_OPEN):
            return pos, pos
        if not final and FUNCTION_OPEN.startswith(rest):  # blanks so far, or the tag's beginning
            return -1, pos
        pos = text.find(TOOL_CALL_OPEN, pos + 1)
    return -1, len(text) if final else len(text) - _partial_suffix(text, TOOL_CALL_OPEN)


@attrs.define
class OutputParser:
    """Feed it an answer's text as it arrives; each step returns what is now settled."""

    reasoning: bool  # the prompt opened a <think> block
    tools: dict[str, dict] | None  # name -> parameters schema; None: tool calls are not parsed
    split_reasoning: bool = True  # SGLang's separate_reasoning: off keeps reasoning in the content
    max_calls: int | None = None  # parallel_tool_calls: false -> 1
    _buf: str = ""
    _phase: str = "start"
    _blank: str = ""  # whitespace-only content held until other content (or the end, without calls)
    _num_calls: int = 0

    def __attrs_post_init__(self) -> None:
        self._phase = "start" if self.split_reasoning else "content"

    def feed(self, text: str, final: bool = False) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out, final):
            pass
        if final:
            if self._phase == "reasoning":
                out.reasoning += self._buf
            else:
                self._content(out, self._buf)
            self._buf = ""
            if self._blank and not self._num_calls:
                out.add_content(self._blank)
            self._blank = ""
        return out

    def _step(self, out: Parsed, final: bool) -> bool:
        """Consume what can be settled in the current phase; True when the phase changed."""
        buf = self._buf
        if self._phase == "start":  # an answer may open its own <think> block
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self._phase = head[len(THINK_OPEN):], "reasoning"
                return True
            if THINK_OPEN.startswith(head) and not final:
                return False
            self._phase = "reasoning" if self.reasoning else "content"
            return True
        if self._phase == "reasoning":
            return self._reasoning_step(out, final)
        if self._phase == "content":
            return self._content_step(out, final)
        return self._call_step(out, final)

    def _reasoning_step(self, out: Parsed, final: bool) -> bool:
        buf = self._buf
        end = buf.find(THINK_CLOSE)
        call, hold = _call_start(buf, final) if self.tools is not None else (-1, len(buf))
        if end >= 0 and (call < 0 or end < call):
            out.reasoning += buf[:end]
            self._buf, self._phase = buf[end + len(THINK_CLOSE):], "content"
            return True
        if call >= 0:
            out.reasoning += buf[:call]
            self._buf, self._phase = buf[call:], "content"
            return True
        if not final:
            hold = min(hold, len(buf) - _partial_suffix(buf, THINK_CLOSE))
            out.reasoning += buf[:hold]
            self._buf = buf[hold:]
        return False

    def _content_step(self, out: Parsed, final: bool) -> bool:
        buf = self._buf
        if self.tools is None:
            self._content(out, buf)
            self._buf = ""
            return False
        start = buf.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._content(out, buf[:start])
            self._buf, self._phase = buf[start:], "call"
            return True
        if not final:
            keep = _partial_suffix(buf, TOOL_CALL_OPEN)
            self._content(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
        return False

    def _call_step(self, out: Parsed, final: bool) -> bool:
        buf = self._buf
        end = buf.find(TOOL_CALL_CLOSE)
        if end < 0:
            if final:
                log.warning("a tool call was cut off before %s; it stays content: %r", TOOL_CALL_CLOSE, buf[:120])
                self._phase = "content"
            return False
        block = buf[:end + len(TOOL_CALL_CLOSE)]
        self._buf, self._phase = buf[end + len(TOOL_CALL_CLOSE):], "content"
        try:
            call = parse_block(block[len(TOOL_CALL_OPEN):end], self.tools or {})
        except MalformedToolCall as e:
            log.warning("a <tool_call> block is not a call (%s); it stays content", e)
            self._content(out, block)
            return True
        if self.max_calls is not None and self._num_calls >= self.max_calls:
            log.warning("tool call %s dropped: parallel_tool_calls is false and the answer already made a call",
                        call.name)
            return True
        self._num_calls += 1
        out.calls.append(call)
        return True

    def _content(self, out: Parsed, text: str) -> None:
        if not text:
            return
        self._blank += text
        # trailing whitespace waits: a call may follow it (then it is dropped), so a whole answer and
        # its streamed pieces agree however the text was cut
        settled = self._blank.rstrip()
        if settled:
            out.add_content(settled)
            self._blank = self._blank[len(settled):]


def parse_all(parser: OutputParser, text: str) -> Parsed:
    """A whole answer at once: what the streamed steps give, joined."""
    return parser.feed(text, final=True)
