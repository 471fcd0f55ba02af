"""OpenAI response shapes: completion and chat objects, stream chunks, logprobs, usage, errors."""

from __future__ import annotations

import json
import time

from bi_core.models.tokenizer import Tokenizer


def sse(obj: dict | list | str) -> str:
    """One server-sent event: ``data: <json>`` (or the literal, e.g. ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, request_id: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, **extra}


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def token_name(tokenizer: Tokenizer | None, token: int, as_ids: bool) -> str:
    """How logprobs name a token: its text, or with ``as_ids`` (vLLM's return_tokens_as_token_ids)
    ``token_id:<id>``, which tells apart tokens of the same text (e.g. partial UTF-8 bytes)."""
    return f"token_id:{token}" if as_ids else token_text(tokenizer, token)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]],
                        offset: int, as_ids: bool = False) -> dict:
    """The legacy completions format; ``offset``: characters of text before these tokens. Its top
    logprobs are dicts by token name, so tokens are named one name each (``Tokenizer.token_name``:
    half a character is ``bytes:\\xNN``, not the U+FFFD every such token decodes to alone)."""
    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids or tokenizer is None else tokenizer.token_name(t)

    offsets = []
    for t in token_ids:
        offsets.append(offset)
        offset += len(token_text(tokenizer, t))
    return {"tokens": [name(t) for t in token_ids], "token_logprobs": list(logprobs),
            "top_logprobs": [{name(i): lp for i, lp in top.items()} for top in tops]
            if tops else None, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]],
                  num_top: int, as_ids: bool = False) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = token_text(tokenizer, token)
        raw = tokenizer.token_bytes(token) if tokenizer is not None else text.encode("utf-8")
        return {"token": token_name(tokenizer, token, as_ids), "logprob": lp, "bytes": list(raw)}

    content = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs)):
        best = sorted(tops[i].items(), key=lambda kv: -kv[1])[:num_top] if tops else []
        content.append({**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in best]})
    return {"content": content}
