"""OpenAI response shapes: completion and chat objects, stream chunks, logprobs (the sampled
tokens', and with echo or vLLM's prompt_logprobs the prompt's), usage, errors."""

from __future__ import annotations

import json
import time

import attrs

from bi_core.models.tokenizer import Tokenizer
from bi_core.runtime.sequence import RequestOutput


def sse(obj: dict | list | str) -> str:
    """One server-sent event: ``data: <json>`` (or the literal, e.g. ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens the prefix cache served
    (``prompt_tokens_details``, known once the requests finished)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def envelope(kind: str, request_id: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, **extra}


def without_generated(o: RequestOutput) -> RequestOutput:
    """A request run for its prompt alone (``max_tokens`` 0 with echo, SGLang's ``max_new_tokens``
    0): the engine samples one token, whose step is the prompt's last chunk anyway, and the answer
    drops it, as vLLM's echo without generation does. Its end is ``length`` (of 0); an abort or an
    error stays what it was."""
    end = o.finish_reason if o.finish_reason in ("abort", "error") else "length"
    return attrs.evolve(o, token_ids=[], token_logprobs=[], logprobs=[] if o.logprobs is not None else None,
                        text="", finish_reason=end, stop_reason=None, samples=None)


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def token_name(tokenizer: Tokenizer | None, token: int, as_ids: bool) -> str:
    """How logprobs name a token: its text, or with ``as_ids`` (vLLM's return_tokens_as_token_ids)
    ``token_id:<id>``, which tells apart tokens of the same text (e.g. partial UTF-8 bytes)."""
    return f"token_id:{token}" if as_ids else token_text(tokenizer, token)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float | None],
                        tops: list[dict[int, float] | None], offset: int, as_ids: bool = False) -> dict:
    """The legacy completions format; ``offset``: characters of text before these tokens; a top
    entry of None (an echoed prompt's first token) stays null. Its top logprobs are dicts by token
    name, so tokens are named one name each (``Tokenizer.token_name``: half a character is
    ``bytes:\\xNN``, not the U+FFFD every such token decodes to alone)."""
    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids or tokenizer is None else tokenizer.token_name(t)

    offsets = []
    for t in token_ids:
        offsets.append(offset)
        offset += len(token_text(tokenizer, t))
    return {"tokens": [name(t) for t in token_ids], "token_logprobs": list(logprobs),
            "top_logprobs": [None if top is None else {name(i): lp for i, lp in top.items()} for top in tops]
            if tops else None, "text_offset": offsets}


def prompt_top(entry: dict[int, float], token: int, num_top: int, num_computed: int) -> dict[int, float]:
    """A prompt token's top-``num_top`` and the token itself, from the engine's entry for it: its
    top-``num_computed`` in rank order, then the token when it is not among them."""
    keep = {t: entry[t] for t in list(entry)[:min(num_top, num_computed)]}
    keep[token] = entry[token]
    return keep


def echo_logprobs(tokenizer, o: RequestOutput, num_top: int, num_computed: int, as_ids: bool = False) -> dict:
    """Completions' logprobs with echo: the prompt's tokens (the first one's logprob and top
    null, as OpenAI's and vLLM's), then the generated ones."""
    ids, table = o.prompt_token_ids, o.prompt_logprobs or []
    lps: list[float | None] = [None]
    tops: list[dict[int, float] | None] = [None]
    for p in range(1, len(ids)):
        entry = table[p] if p < len(table) else None  # an abort may end it before its prompt ran
        lps.append(entry[ids[p]] if entry else None)
        tops.append(prompt_top(entry, ids[p], num_top, num_computed) if entry else None)
    prompt = completion_logprobs(tokenizer, ids, lps, tops, 0, as_ids)
    end = prompt["text_offset"][-1] + len(token_text(tokenizer, ids[-1]))
    out = completion_logprobs(tokenizer, o.token_ids, o.token_logprobs, o.logprobs or [], end, as_ids)
    return {"tokens": prompt["tokens"] + out["tokens"], "token_logprobs": prompt["token_logprobs"] + out["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + (out["top_logprobs"] or []),
            "text_offset": prompt["text_offset"] + out["text_offset"]}


def prompt_logprobs(tokenizer, o: RequestOutput, num_top: int, num_computed: int) -> list:
    """vLLM's ``prompt_logprobs`` of a completion choice: null for the first token, then per
    token ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for it and its top-``num_top``. A
    rank is the token's place in the top-``num_computed`` the engine computed (1 = most likely);
    a prompt token below them has rank null."""
    ids, table = o.prompt_token_ids, o.prompt_logprobs or []
    out: list[dict | None] = [None]
    for p in range(1, len(ids)):
        entry = table[p] if p < len(table) else None
        if not entry:
            out.append(None)
            continue
        ranked = list(entry)[:num_computed]
        rank = {t: r for r, t in enumerate(ranked, 1)}
        out.append({str(t): {"logprob": lp, "rank": rank.get(t), "decoded_token": token_text(tokenizer, t)}
                    for t, lp in prompt_top(entry, ids[p], num_top, num_computed).items()})
    return out


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
