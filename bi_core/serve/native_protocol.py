"""SGLang's ``/generate`` request (``GenerateReqInput``) and its ``sampling_params``: the fields
this engine serves, SGLang's names and defaults (``min_new_tokens``, ``no_stop_trim``,
``skip_special_tokens``, ``spaces_between_special_tokens``, the penalties and ``min_p`` are the
engine's SamplingParams by vLLM's names; ``json_schema``, ``regex`` and ``ebnf`` a structured
output, ``serve/structured_fields.py``). SGLang's parameters the engine does not implement
are accepted at their no-op values (a penalty of 0, no structural tag, an empty ``stop_regex``, ...) and
refused with a reason at any other; unknown fields are refused. ``custom_params`` is accepted and
reported unused (the ``X-Unused-Params`` header): SGLang hands it to a custom logit processor
only, and none runs here, as none runs in an SGLang server started without one. A
``custom_logit_processor`` (code) is never run: refused."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator

from bi_core.serve.openai_protocol import MAX_N, STRICT, TextBody, only

NOT_IMPLEMENTED = "not implemented by this engine"


class GenerateSamplingParams(BaseModel):
    """SGLang's ``sampling_params``: the ones the engine implements, the others at their no-op values."""

    model_config = STRICT

    max_new_tokens: int | None = Field(128, ge=0, description="None: up to the model's context length; 0: the "
                                                              "prompt alone (its logprobs), as SGLang's scoring")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 = off")
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    sampling_seed: int | None = Field(None, ge=0, lt=2**63)
    min_new_tokens: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.0, le=2.0, description="SGLang's range; 1 = off")
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = Field(False, description="a matched stop string (or stop token) stays in the text")
    # structured outputs (one at most); masked_logprobs (bi-engine's): logprobs after the grammar's mask
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    masked_logprobs: bool = False
    # SGLang's parameters the engine does not implement: accepted at their no-op value only
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None  # accepted, reported unused (the module's docstring says why)
    stream_interval: int | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v == 0:  # SGLang's range takes 0; the engine divides by it
            raise ValueError("repetition_penalty must be > 0 (1 = off)")
        return v

    _no_structural_tag = field_validator("structural_tag")(only(
        None, why=f"structural tags are {NOT_IMPLEMENTED} (json_schema, regex and ebnf are)"))
    _no_stop_regex = field_validator("stop_regex")(only(
        None, [], why=f"stop regexes are {NOT_IMPLEMENTED}; use stop strings (stop)"))
    _no_interval = field_validator("stream_interval")(only(None, why="a stream sends every step's tokens"))

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError(f"only null or an empty object is supported: logit_bias is {NOT_IMPLEMENTED}")
        return v

    def unused(self) -> list[str]:
        """The fields given that change nothing here, which the answer reports."""
        return ["custom_params"] if self.custom_params is not None else []


class GenerateRequest(TextBody):
    """SGLang's ``GenerateReqInput`` (the fields this engine serves; unknown fields are refused)."""

    model_config = STRICT

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)
    log_metrics: bool = True
    image_data: Any = None  # per prompt an image or a list (serve/media.py)
    video_data: Any = None  # per prompt a video (a list of frames) or a list of them
    # SGLang inputs the engine does not take: accepted only absent (null)
    input_embeds: Any = None
    audio_data: Any = None
    custom_logit_processor: Any = None
    # SGLang's: the LoRA adapter (a loaded adapter's name) of the request, or one per prompt (null: the base model)
    lora_path: str | list[str | None] | None = None
    token_ids_logprob: Any = None
    session_params: Any = None
    return_hidden_states: bool = False
    # what sglang-router writes into every /generate it forwards: its model field (null, or this
    # server's model), and SGLang's output switches at the values that change nothing here
    model: str | None = None
    background: bool = False
    no_logs: bool = False  # requests are never logged here
    return_bytes: bool = False
    return_entropy: bool = False

    @field_validator("input_embeds", "audio_data", "token_ids_logprob", "session_params")
    @classmethod
    def _absent(cls, v):
        if v is not None:
            raise ValueError("not supported by this engine; leave it out (null)")
        return v

    @field_validator("custom_logit_processor")
    @classmethod
    def _no_code(cls, v):
        if v is not None:
            raise ValueError("a custom logit processor is code sent with the request; this server never runs code "
                             "a request carries (and SGLang runs one only when started with "
                             "--enable-custom-logit-processor); leave it out (null)")
        return v

    _no_hidden_states = field_validator("return_hidden_states")(only(
        False, why="hidden states are not returned by this engine"))
    _not_offered = field_validator("background", "return_bytes", "return_entropy")(only(
        False, why="not supported by this engine"))
    _always_counted = field_validator("log_metrics")(only(True, why="every request is counted in /metrics"))


REQUEST_MODELS = {"/generate": GenerateRequest}
