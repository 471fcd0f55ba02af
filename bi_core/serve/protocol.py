"""OpenAI request models (with vLLM's extensions: top_k, stop_token_ids, ignore_eos,
return_tokens_as_token_ids; SGLang's that sglang-router adds to what it forwards, at their no-op
values) and the mapping to SamplingParams. Validation errors name the field;
unknown fields are refused, so a misspelled parameter never silently does nothing; types are strict
as OpenAI's are (``"max_tokens": "8"`` and ``"stream": "yes"`` are refused; an int is a float)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bi_core.runtime.sequence import SamplingParams

MAX_N = 128
STRICT = ConfigDict(extra="forbid", strict=True)


def only(value: bool, why: str):
    """A validator taking a flag at ``value`` alone (the value that changes nothing here)."""
    def check(cls, v: bool) -> bool:
        if v is not value:
            raise ValueError(f"only {str(value).lower()} is supported: {why}")
        return v

    return check


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(BaseModel):
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # SGLang's extensions, which sglang-router writes into every request it forwards: accepted at the
    # values that change nothing here (the text is the tokenizer's plain decode, cut before a stop string)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported (they would make a token depend on earlier samples' "
                             "counts, which the engine does not track); use 0")
        return v

    _plain_decode = field_validator("skip_special_tokens")(only(True, "the text is the tokenizer's plain decode"))
    _stop_trimmed = field_validator("no_stop_trim")(only(False, "the text ends before a matched stop string"))
    _no_hidden_states = field_validator("return_hidden_states")(only(False, "no hidden states are returned"))

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request: its ``n`` samples share one prefill, sample i is keyed
        by ``sample_seed(seed, i)`` (bi_core.ops.sampling)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, n=self.n, logprobs=logprobs,
                              stop_token_ids=tuple(self.stop_token_ids or ()), stop=stop, ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list) and any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
            raise ValueError("only text content parts are supported ([{\"type\": \"text\", \"text\": ...}])")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # sglang-router's additions to a chat request: no reasoning parser runs here, so separating
    # reasoning (or streaming it apart) changes nothing; continuing the last message is not supported
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    _no_continue = field_validator("continue_final_message")(only(False, "continuing the final assistant message "
                                                                         "is not supported"))

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def num_logprobs(self) -> int | None:
        """Raises ValueError (about ``top_logprobs``) when top_logprobs comes without logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None
