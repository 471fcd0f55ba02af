"""What the chat route adds to a completion: the prompt (the chat template with the request's tools
and template variables, or an episode's exact ids extended by new messages) and the answer's
message (reasoning, content and tool calls split by ``chat_output``), whole or as stream deltas.

Field names: the answer's reasoning is ``reasoning_content`` (DeepSeek's, SGLang's, vLLM's before
0.11) and ``reasoning`` (vLLM's now), both; ``include_reasoning: false`` (vLLM) leaves it out and
``separate_reasoning: false`` (SGLang) keeps it in ``content``. A choice that made a tool call and
stopped ends with ``finish_reason: "tool_calls"``. With vLLM's ``return_token_ids`` the response
carries ``prompt_token_ids`` (a stream: in its first chunk) and each choice its ``token_ids``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from bi_core.errors import CheckpointError
from bi_core.models.chat_episode import extend_chat
from bi_core.models.chat_template import ChatPrompt, ChatTemplateError, template_variables
from bi_core.models.tokenizer import Tokenizer
from bi_core.runtime.sequence import RequestOutput
from bi_core.serve import formats
from bi_core.serve.api_errors import ApiError
from bi_core.serve.chat_output import OutputParser, Parsed, parse_all
from bi_core.serve.client import Delta
from bi_core.serve.openai_protocol import ChatCompletionRequest
from bi_core.serve.structured_fields import tool_choice_spec
from bi_core.serve.tool_call_parser import ToolCall, tool_parameters

if TYPE_CHECKING:
    from bi_core.serve.server import Server
    from bi_core.structured.specs import StructuredSpec


def chat_prompt(server: Server, req: ChatCompletionRequest) -> ChatPrompt:
    """The request's prompt; a conversation the template refuses is a 400 naming the field."""
    tokenizer = server.tokenizer
    if tokenizer is None:
        raise ApiError(400, "chat needs a tokenizer; this checkpoint has none", param="messages")
    kwargs = req.template_kwargs()
    template = tokenizer.chat_template
    if req.reasoning_effort is not None and template and "reasoning_effort" not in template_variables(template):
        raise ApiError(400, "reasoning_effort: this model's chat template does not read it (Qwen3.5 thinks or not: "
                            "chat_template_kwargs.enable_thinking), so it would change nothing", param="reasoning_effort")
    try:
        if req.previous_token_ids is not None:
            bad = [t for t in req.previous_token_ids if not 0 <= t < server.vocab_size]
            if bad:
                raise ApiError(400, f"previous_token_ids has ids outside the vocabulary [0, {server.vocab_size}): "
                                    f"{bad[:5]}", param="previous_token_ids")
            return extend_chat(tokenizer, req.previous_token_ids, req.conversation(), tools=req.tools,
                               add_generation_prompt=req.add_generation_prompt, template_kwargs=kwargs)
        return tokenizer.chat(req.conversation(), tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message, template_kwargs=kwargs)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param=e.param) from None
    except CheckpointError as e:
        raise ApiError(400, str(e), param="messages") from None


@attrs.frozen
class ChatTurn:
    """One chat request's prompt and how its answers are read."""

    req: ChatCompletionRequest
    prompt: ChatPrompt

    @property
    def reasons(self) -> bool:
        """Whether the answer starts with reasoning: the prompt opened a ``<think>`` block and no
        response format or guided output constrains the text from its first token (those grammars
        have no reasoning part, so what they match is the content)."""
        return self.prompt.opens_reasoning and self.req.structured_spec is None

    def parser(self) -> OutputParser:
        tools = self.req.parsed_tools()
        return OutputParser(reasoning=self.reasons,
                            tools=tool_parameters(tools) if tools is not None else None,
                            split_reasoning=self.req.separate_reasoning,
                            max_calls=1 if self.req.parallel_tool_calls is False else None)

    def constraint(self) -> StructuredSpec | None:
        """The request's structured output once ``tool_choice`` counts: "required" or a named
        function constrain the answer to Qwen3.5's tool-call grammar (``structured.tool_calls``), so
        even a random-weight model writes a valid call; after the reasoning when the prompt opened a
        ``<think>`` block (the grammar leaves the reasoning free up to ``</think>``)."""
        given = self.req.structured_spec
        spec = tool_choice_spec(given, self.req.tools, self.req.tool_choice,
                                parallel_tool_calls=self.req.parallel_tool_calls,
                                reasoning="enabled" if self.prompt.opens_reasoning else "disabled")
        if spec is not None and spec is not given and self.req.min_tokens:
            raise ApiError(400, "min_tokens must be 0 with tool_choice required or a named function: the tool-call "
                                "grammar decides where the answer ends", param="min_tokens")
        return spec

    def top_fields(self) -> dict:
        """Response fields beside the choices: vLLM's ``prompt_token_ids``."""
        return {"prompt_token_ids": self.prompt.ids} if self.req.return_token_ids else {}

    def finish_reason(self, o: RequestOutput, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and o.finish_reason == "stop" else o.finish_reason

    def message(self, o: RequestOutput) -> tuple[dict, str | None]:
        """A finished answer's message and finish reason."""
        parsed = parse_all(self.parser(), o.text or "")
        message = {"role": "assistant", "content": parsed.content or (None if parsed.calls else "")}
        if self.reasons or parsed.reasoning:
            self._reasoning(message, parsed.reasoning or None)
        if parsed.calls:
            message["tool_calls"] = [call.as_openai() for call in parsed.calls]
        return message, self.finish_reason(o, bool(parsed.calls))

    def delta(self, parsed: Parsed, first_call: int) -> dict:
        """A stream chunk's delta; ``first_call``: the index of the first call in ``parsed``."""
        out: dict = {}
        if parsed.reasoning:
            self._reasoning(out, parsed.reasoning)
        if parsed.content:
            out["content"] = parsed.content
        if parsed.calls:
            out["tool_calls"] = [_call_delta(first_call + i, call) for i, call in enumerate(parsed.calls)]
        return out

    def stream(self, num_choices: int, tokenizer) -> ChatStream:
        return ChatStream(self, tokenizer, [self.parser() for _ in range(num_choices)], [0] * num_choices)

    def _reasoning(self, into: dict, text: str | None) -> None:
        if self.req.include_reasoning:
            into["reasoning_content"] = into["reasoning"] = text


def _call_delta(index: int, call: ToolCall) -> dict:
    return {"index": index, **call.as_openai()}


@attrs.define
class ChatStream:
    """A streamed chat answer's choices: each its own parser, and the calls it has sent."""

    turn: ChatTurn
    tokenizer: Tokenizer
    parsers: list[OutputParser]
    calls_sent: list[int]

    def choice(self, index: int, output: RequestOutput | None, delta: Delta) -> dict | None:
        """The chunk's choice for a delta, or None when the delta settled nothing worth a chunk."""
        req = self.turn.req
        parsed = self.parsers[index].feed(delta.text, final=delta.finished)
        body = self.turn.delta(parsed, self.calls_sent[index])
        self.calls_sent[index] += len(parsed.calls)
        ids_wanted = delta.token_ids and (req.logprobs or req.return_token_ids)
        if not body and not delta.finished and not ids_wanted:
            return None
        lp = (formats.chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs,
                                    req.top_logprobs or 0, req.return_tokens_as_token_ids)
              if req.logprobs and delta.token_ids else None)
        finish = self.turn.finish_reason(output, self.calls_sent[index] > 0) if delta.finished else None
        out = {"index": index, "delta": body, "logprobs": lp, "finish_reason": finish}
        if req.return_token_ids:
            out["token_ids"] = delta.token_ids
        return out
