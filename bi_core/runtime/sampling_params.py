"""SamplingParams: how one request is decoded (vLLM's field names), checked when it is built:
a bad value is one RequestError naming the field, the allowed values and what it got."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import attrs

from bi_core.errors import RequestError
from bi_core.runtime.prompts import is_token_id
from bi_core.structured.specs import StructuredSpec

SEED_LIMIT = 2**64  # seeds are mixed as 64-bit words (ops/sampling.py mix_seed): larger ones would alias smaller
MAX_LOGPROBS = 20


def _fail(message: str) -> None:
    raise RequestError(f"SamplingParams: {message}")


def _check(cond: bool, message: str) -> None:
    if not cond:
        _fail(message)


def _is_int(value) -> bool:
    return is_token_id(value)  # Python, numpy or torch integers; not bools


def _as_int(value):
    """An integer of any kind as a Python int (numpy's would overflow in seed mixing); anything
    else as it came, for the check to name."""
    return operator.index(value) if _is_int(value) else value


def _is_number(value) -> bool:
    """A finite int or float (not a bool)."""
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _stop_strings(value) -> tuple[str, ...]:
    """One stop string, or a sequence of them."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable) or isinstance(value, bytes):
        _fail(f"stop must be a string or a list of strings, got {value!r}")
    items = tuple(value)
    _check(all(isinstance(s, str) for s in items), f"stop must be strings, got {items!r}")
    return items


def _token_ids(value) -> tuple[int, ...]:
    """One token id, or a sequence of them, as Python ints (the range is checked against the
    vocabulary when the request is added)."""
    if _is_int(value):
        return (operator.index(value),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        _fail(f"stop_token_ids must be a token id or a list of token ids (ints), got {value!r}")
    items = tuple(value)
    bad = [t for t in items if not _is_int(t)]
    _check(not bad, f"stop_token_ids must be ints, got {bad[:5]!r}")
    return tuple(operator.index(t) for t in items)


LOGPROBS_MODES = ("raw", "temperature")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request is decoded. ``seed`` keys its randomness: draws depend only on (seed, position)."""

    max_new_tokens: int = attrs.field(default=16, converter=_as_int)
    n: int = attrs.field(default=1, converter=_as_int)  # samples, prefilled once; i keyed by sample_seed(seed, i)
    temperature: float = 0.0
    top_k: int = attrs.field(default=0, converter=_as_int)
    top_p: float = 1.0
    seed: int | None = attrs.field(default=None, converter=_as_int)  # in [0, 2**64)
    # top-N logprobs per step (vLLM style); None = only the sampled token's
    logprobs: int | None = attrs.field(default=None, converter=_as_int)
    # also the logprob (and top-N) of every prompt token after the first
    prompt_logprobs: int | None = attrs.field(default=None, converter=_as_int)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)  # ends when the text contains one
    ignore_eos: bool = False
    # vLLM's: a stop token, EOS or stop string ends the request only after min_tokens generated
    # tokens (their logits are -inf until then; EOS too with ignore_eos, as vLLM masks it)
    min_tokens: int = attrs.field(default=0, converter=_as_int)
    min_p: float = 0.0  # drop tokens whose probability (after temperature) is below min_p x the top one's
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (vLLM/HF); 1 = off
    presence_penalty: float = 0.0  # OpenAI's, over the output tokens: subtracted once per distinct token
    frequency_penalty: float = 0.0  # OpenAI's, over the output tokens: subtracted per occurrence
    # the text (vLLM's detokenization options): a matched stop string, or the stop token that ended
    # it, stays at its end (SGLang's no_stop_trim); special tokens kept, spaced from their neighbours
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # the top-k expert ids of every MoE layer for each position that ran through the model
    # (routing replay; needs model.enable_return_routed_experts)
    return_routed_experts: bool = False
    # which distribution token_logprobs and logprobs are of: "raw" the model's (vLLM's default),
    # "temperature" the one sampled at this request's temperature, log_softmax(logits / T) (SGLang's
    # default, what RL trainers compute; the same as raw for greedy requests and at T = 1)
    logprobs_mode: str = "raw"
    # structured outputs: what the text must match (a JSON schema, a regex, a grammar, a Qwen3.5
    # tool call...; bi_core.structured); its grammar masks each token's logits. The request ends
    # where its grammar ends (a stop token or EOS, which the grammar allows only there)
    structured: StructuredSpec | None = None
    # the reported logprobs (and top-N) are of the distribution after the grammar's mask (the
    # allowed tokens only; at the temperature with logprobs_mode "temperature"); by default the raw one's
    masked_logprobs: bool = False

    def __attrs_post_init__(self) -> None:
        self._check_counts()
        self._check_floats()
        _check(self.structured is None or isinstance(self.structured, StructuredSpec),
               f"structured must be a bi_core.structured.StructuredSpec (or None), got {type(self.structured).__name__}")
        _check(self.structured is None or self.min_tokens == 0,
               f"min_tokens must be 0 with structured outputs, got {self.min_tokens}: the grammar decides where the "
               "output ends, and banning its end could leave no token allowed")
        for name in ("ignore_eos", "return_routed_experts", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "masked_logprobs"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(self.logprobs_mode in LOGPROBS_MODES,
               f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    def _check_counts(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, f"n must be a positive int, got {self.n!r}")
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens, f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        _check(self.min_tokens <= self.max_new_tokens,
               f"min_tokens ({self.min_tokens}) must be at most max_new_tokens ({self.max_new_tokens})")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT),
               f"seed must be an int in [0, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                   f"{name} must be an int in 0..{MAX_LOGPROBS} (or None), got {v!r}")

    def _check_floats(self) -> None:
        _check(_is_number(self.temperature) and self.temperature >= 0.0,
               f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
               f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -2.0 <= v <= 2.0, f"{name} must be in [-2, 2], got {v!r}")

    @property
    def decode_options(self) -> dict[str, bool]:
        """The tokenizer's ``decode`` options for this request's text."""
        return {"skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens}

    @property
    def logprob_temperature(self) -> float:
        """The temperature its reported logprobs are at (1.0: the raw distribution)."""
        return self.temperature if self.logprobs_mode == "temperature" and self.temperature > 0.0 else 1.0

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, presence or frequency penalty changes its logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
