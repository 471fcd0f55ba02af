"""OpenAI request models (with vLLM's extensions: top_k, stop_token_ids, ignore_eos, min_tokens,
min_p, repetition_penalty, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, return_tokens_as_token_ids, prompt_logprobs,
stream_options.continuous_usage_stats, structured_outputs and guided_*; SGLang's that
sglang-router adds to what it forwards) and the mapping to SamplingParams (structured outputs:
``structured_fields.py``). Validation errors name
the field; unknown fields are refused, so a misspelled parameter never silently does nothing;
parameters the engine does not implement are accepted at the value that changes nothing (their
default) and refused with a reason at any other; types are strict as OpenAI's are (``"max_tokens":
"8"`` and ``"stream": "yes"`` are refused; an int is a float)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from bi_core.runtime.sequence import SamplingParams
from bi_core.serve.api_errors import ApiError
from bi_core.serve.chat_messages import ChatMessage, check_tool_choice, check_tools
from bi_core.serve.structured_fields import request_spec
from bi_core.structured.specs import StructuredSpec

MAX_N = 128
MAX_LOGPROBS = 20  # the engine's limit (SamplingParams.logprobs, prompt_logprobs)
STRICT = ConfigDict(extra="forbid", strict=True)


def only(*values, why: str):
    """A validator taking a field at one of ``values`` alone (the values that change nothing here).
    Booleans compare by identity, so ``0`` never passes for ``False``."""
    def same(v, w) -> bool:
        return v is w if isinstance(w, bool) or w is None else type(v) is not bool and v == w

    def check(cls, v):
        if not any(same(v, w) for w in values):
            shown = " or ".join("null" if w is None else str(w).lower() if isinstance(w, bool) else repr(w)
                                for w in values)
            raise ValueError(f"only {shown} is supported: {why}")
        return v

    return check


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where in a parsed JSON value a string holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``
    without its pair), or None. Such a string has no UTF-8 form: it can be neither tokenized nor
    written back in a response. The path is OpenAI's param form (``messages[0].content``)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if lone_surrogate_at(key, inner) is not None:  # in the key itself: name it escaped
                return f"{path}.{ascii(key)}" if path else ascii(key)
            if (found := lone_surrogate_at(item, inner)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := lone_surrogate_at(item, f"{path}[{i}]")) is not None:
                return found
    return None


class TextBody(BaseModel):
    """A request body whose strings must all be text (no lone surrogates): refused with a 400 that
    names the field, before anything tokenizes or echoes them. An ApiError rather than a
    ValueError, which pydantic would report at the body's root instead of at the field."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if (path := lone_surrogate_at(data)) is not None:
            raise ApiError(400, f"{path}: a string holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without "
                                "its pair), which is not text; send the character itself or its surrogate pair",
                           param=path)
        return data


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage in every chunk (vLLM), with include_usage")


_NOT_IMPLEMENTED = "not implemented by this engine"


class _Common(TextBody):
    """Parameters both endpoints share."""

    model_config = STRICT

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = Field(False, description="logprobs name tokens 'token_id:<id>' (vLLM)")
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's sampling extensions (SamplingParams' fields of the same names)
    repetition_penalty: float = Field(1.0, gt=0.0, description="1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # SGLang's, which sglang-router writes into every request it forwards: no_stop_trim is
    # include_stop_str_in_output by SGLang's name; hidden states are never returned
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # structured outputs (structured_fields.py; response_format on each endpoint): vLLM's fields,
    # and whether the logprobs reported are of the distribution after the grammar's mask (bi-engine's)
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    masked_logprobs: bool = False
    _structured: StructuredSpec | None = PrivateAttr(None)
    # OpenAI's and vLLM's parameters the engine does not implement: accepted at their no-op values
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0

    _no_bias = field_validator("logit_bias")(lambda cls, v: _empty(v, "logit_bias"))
    _no_truncation = field_validator("truncate_prompt_tokens")(only(None, why="prompts are never truncated"))
    _no_beams = field_validator("use_beam_search")(only(False, why="beam search is not implemented"))
    _no_length_penalty = field_validator("length_penalty")(only(1, why="it applies to beam search only"))
    _one_priority = field_validator("priority")(only(0, why="requests are served in arrival order"))
    _no_hidden_states = field_validator("return_hidden_states")(only(False, why="no hidden states are returned"))

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true (as OpenAI's API)",
                           param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            raise ApiError(400, "stream_options.continuous_usage_stats needs include_usage: true (usage in every "
                                "chunk is usage included)", param="stream_options.continuous_usage_stats")
        return self

    @model_validator(mode="after")
    def _structured_output(self):
        self._structured = request_spec(self)
        if self._structured is not None and self.min_tokens:
            raise ApiError(400, "min_tokens must be 0 with a structured output: the grammar decides where the output "
                                "ends, and banning its end could leave no token allowed", param="min_tokens")
        return self

    @property
    def structured_spec(self) -> StructuredSpec | None:
        """The structured output the request's own fields ask for (``structured_fields.request_spec``)."""
        return self._structured

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_new_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """SamplingParams of this request: its ``n`` samples share one prefill, sample i is keyed
        by ``sample_seed(seed, i)`` (bi_core.ops.sampling)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if self.min_tokens > max_new_tokens:
            raise ApiError(400, f"min_tokens ({self.min_tokens}) must be at most the tokens this request may "
                                f"generate ({max_new_tokens})", param="min_tokens")
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, n=self.n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            stop_token_ids=tuple(self.stop_token_ids or ()), stop=stop, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured=self._structured, masked_logprobs=self.masked_logprobs)


def _empty(v, name: str):
    if v:
        raise ValueError(f"only null or an empty object is supported: {name} is {_NOT_IMPLEMENTED}")
    return v


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0: no tokens, with echo (the prompt's logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: per prompt token")
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict | None = None  # as chat's (vLLM takes it on completions too)

    _no_suffix = field_validator("suffix")(only(None, "", why="suffix (insertion) is not supported"))

    @model_validator(mode="after")
    def _echo_and_counts(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of must equal n ({self.n}) or be null: picking the best of more samples is "
                                f"{_NOT_IMPLEMENTED}", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens 0 generates nothing: it needs echo: true (the prompt back, with its "
                                "logprobs if logprobs is set)", param="max_tokens")
        if self.stream and (self.echo or self.prompt_logprobs is not None):
            param = "echo" if self.echo else "prompt_logprobs"
            raise ApiError(400, f"{param} is supported without stream (the prompt's logprobs come with the finished "
                                "request)", param=param)
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def num_prompt_logprobs(self) -> int | None:
        """The top-N the engine computes per prompt token: echo's logprobs, vLLM's prompt_logprobs,
        the larger of the two when both are asked for (each answer keeps its own N)."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict | None = None  # text, json_object or json_schema (structured_fields.py)
    # OpenAI's and vLLM's chat parameters the engine does not implement: their no-op values
    echo: bool = False
    # tools (tool_calls in the answer; required and a named function are constrained decoding's:
    # chat.ChatTurn.constraint),
    # the chat template's inputs (chat_template_kwargs: variables the template reads, such as
    # enable_thinking), reasoning (vLLM's include_reasoning and reasoning_effort, SGLang's
    # separate_reasoning), vLLM's return_token_ids, and an episode's exact ids (previous_token_ids)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_token_ids: bool | None = None
    previous_token_ids: list[int] | None = Field(None, min_length=1, description=(
        "an episode's ids so far (the previous answer's prompt_token_ids, then its token_ids); messages then "
        "holds only the new messages, rendered as the template renders what follows that turn"))

    _no_echo = field_validator("echo")(only(False, why="echoing the last message is not supported"))
    _checked_tools = field_validator("tools")(lambda cls, v: check_tools(v))
    _streamed_reasoning = field_validator("stream_reasoning")(only(
        True, why="reasoning streams as it is generated (reasoning_content deltas)"))

    @model_validator(mode="after")
    def _tool_choice_and_turns(self):
        try:
            self.tool_choice = check_tool_choice(self.tool_choice, self.tools)
        except ValueError as e:
            raise ApiError(400, str(e), param="tool_choice") from None
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            self.add_generation_prompt = False  # continuing the last message starts no new turn
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true (as vLLM): "
                                "set add_generation_prompt: false to continue the last message",
                           param="continue_final_message")
        if self.previous_token_ids is not None and self.continue_final_message:
            raise ApiError(400, "previous_token_ids continues an episode with new messages; to continue the last "
                                "turn's text, append to its ids and use /generate or a completion",
                           param="previous_token_ids")
        return self

    def template_kwargs(self) -> dict:
        """The chat template's variables this request sets: ``chat_template_kwargs``, and
        ``reasoning_effort`` when given (vLLM passes it the same way; a template that does not read it
        refuses it)."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        return out

    def parsed_tools(self) -> list[dict] | None:
        """The tools whose calls the answer is parsed for: none with tool_choice none."""
        return self.tools if self.tools and self.tool_choice != "none" else None

    def conversation(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]

    def num_logprobs(self) -> int | None:
        """Raises ValueError (about ``top_logprobs``) when top_logprobs comes without logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None
