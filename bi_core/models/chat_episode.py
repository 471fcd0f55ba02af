"""Multi-turn episodes token-in/token-out: the next turn's prompt is the episode's exact ids so far
(the previous turn's prompt and completion as sampled) followed by the new messages' ids, so no
re-rendering or re-tokenization ever changes a trajectory (verl and slime call the alternative a
"false trajectory fork").

The new ids are what the chat template writes after an assistant turn: the rest of that turn's end
(``<|im_end|>`` is the stop token the answer ended on; the template's ``\\n`` after it is added),
then the new messages and the generation prompt. They are found by rendering the messages after a
fixed stand-in context and keeping only what the messages add, checked to be a pure extension of
the context's own rendering (``after.startswith(before)``). The stand-in context is a user turn and
an assistant turn; where the template re-renders that assistant turn once more messages follow
(Qwen3.5 strips the ``<think>`` block of every assistant turn before the last user message), it is
the user turn alone. Earlier ``<think>`` blocks therefore stay in the episode's ids exactly as they
were sampled: the template would strip them on a full re-render, which is the fork this avoids."""

from __future__ import annotations

from typing import Any

from bi_core.models.chat_template import ChatPrompt, ChatTemplateError
from bi_core.models.tokenizer import Tokenizer

ANCHOR_USER = {"role": "user", "content": "bi-engine episode anchor: the user turn"}
ANCHOR_ASSISTANT = {"role": "assistant", "content": "bi-engine episode anchor: the assistant turn"}


def extend_chat(tokenizer: Tokenizer, previous_ids: list[int], messages: list[dict[str, Any]], *,
                tools: list[dict] | None = None, add_generation_prompt: bool = True,
                template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """``previous_ids`` + the end of the previous turn + ``messages`` as the template renders them
    after it (+ the generation prompt). ``text`` is the rendered text of the new part."""
    kwargs = template_kwargs or {}
    turn = tokenizer.chat([ANCHOR_USER, ANCHOR_ASSISTANT], tools=tools, add_generation_prompt=False,
                          template_kwargs=kwargs)
    close = turn_close_ids(tokenizer, turn.text)
    done = next((k for k in range(min(len(close), len(previous_ids)), 0, -1) if previous_ids[-k:] == close[:k]), 0)
    text = rendered_suffix(tokenizer, messages, tools, add_generation_prompt, kwargs)
    return ChatPrompt(list(previous_ids) + close[done:] + tokenizer.encode_rendered(text), text, turn.stop_token_ids)


def turn_close_ids(tokenizer: Tokenizer, rendered_turn: str) -> list[int]:
    """The ids the template writes after an assistant message's content (Qwen3.5: ``<|im_end|>\\n``),
    from its rendering of the stand-in user and assistant turns."""
    at = rendered_turn.rfind(ANCHOR_ASSISTANT["content"])
    if at < 0:
        raise ChatTemplateError("the chat template does not write an assistant message's content, so an episode "
                                "cannot be continued from its ids", param="previous_token_ids")
    return tokenizer.encode_rendered(rendered_turn[at + len(ANCHOR_ASSISTANT["content"]):])


def rendered_suffix(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None,
                    add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
    """What ``messages`` add to a rendered conversation, after the first stand-in context whose own
    rendering the template keeps unchanged when they follow it."""
    refusal: ChatTemplateError | None = None
    for context in ([ANCHOR_USER, ANCHOR_ASSISTANT], [ANCHOR_USER]):
        try:
            before = tokenizer.chat(context, tools=tools, add_generation_prompt=False, template_kwargs=kwargs).text
            after = tokenizer.chat(context + messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   template_kwargs=kwargs).text
        except ChatTemplateError as e:
            refusal = e
            continue
        if after.startswith(before):
            return after[len(before):]
    if refusal is not None:
        raise refusal
    raise ChatTemplateError("the chat template does not render these messages as an extension of the turns before "
                            "them (it rewrites an earlier turn), so they cannot follow previous_token_ids; send the "
                            "whole conversation in messages instead")
