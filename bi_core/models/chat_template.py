"""Chat templates as checkpoints ship them: a conversation rendered by the tokenizer's Jinja template
with transformers' own renderer (the sandbox, filters and ``continue_final_message`` handling that
``apply_chat_template`` uses), the variables a template reads (``chat_template_kwargs`` may set those
and nothing else), and Qwen3.5's template for the byte tokenizer of the random presets."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs

from bi_core.errors import BiEngineError

TEMPLATES = Path(__file__).parent / "templates"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# What the renderer itself passes a template, so chat_template_kwargs may not: each has a request
# field of its own. apply_chat_template's own arguments are refused too: they would reach it as its
# parameters, not as template variables.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                      "conversation", "chat_template", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                      "sanitize_control_tokens"})


class ChatTemplateError(BiEngineError):
    """A conversation the chat template cannot render; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@attrs.frozen
class ChatPrompt:
    """A rendered conversation: its token ids, the text they encode and the ids that end a turn."""

    ids: list[int]
    text: str
    stop_token_ids: tuple[int, ...]

    @property
    def opens_reasoning(self) -> bool:
        """Whether the prompt ends inside a ``<think>`` block (Qwen3.5's generation prompt with
        thinking on), so the answer starts with reasoning; with ``enable_thinking: false`` the
        template closes the block itself."""
        return self.text.rfind(THINK_OPEN) > self.text.rfind(THINK_CLOSE)


@functools.cache
def qwen3_5_template() -> str:
    """Qwen3.5's chat template (the checkpoints' ``chat_template.jinja``): thinking, and tool calls in
    its XML form (``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...``)."""
    return (TEMPLATES / "qwen3_5.jinja").read_text()


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads that it neither defines nor gets from the renderer's globals."""
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(template).environment
    return frozenset(meta.find_undeclared_variables(env.parse(template)) - set(env.globals))


def check_template_kwargs(template: str, kwargs: dict[str, Any]) -> None:
    """Every key of ``chat_template_kwargs`` must be a variable this template reads (else it would do
    nothing) and none may be one of the renderer's own inputs."""
    readable = sorted(template_variables(template) - RESERVED)
    for key in kwargs:
        if key in RESERVED:
            raise ChatTemplateError(f"chat_template_kwargs.{key}: {key} is not a template variable here: the "
                                    "request field of that name sets it", param=f"chat_template_kwargs.{key}")
        if key not in readable:
            shown = ", ".join(readable) or "none"
            raise ChatTemplateError(f"chat_template_kwargs.{key}: this model's chat template does not read {key}, so "
                                    f"it would change nothing; the variables it reads: {shown}",
                                    param=f"chat_template_kwargs.{key}")


def render(template: str, messages: list[dict], *, tools: list[dict] | None, add_generation_prompt: bool,
           continue_final_message: bool, template_kwargs: dict[str, Any], defaults: dict[str, Any] | None = None
           ) -> str:
    """The template's text for a conversation, as ``apply_chat_template(tokenize=False)`` renders it:
    message keys whose value is None are dropped first, as transformers does; ``defaults`` are the
    variables the tokenizer itself passes (transformers passes its special tokens: ``eos_token``, ...),
    which ``template_kwargs`` may override."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    check_template_kwargs(template, template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: the first "
                                "continues the last message, the second starts a new assistant turn",
                                param="continue_final_message")
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        rendered, _ = render_jinja_template([chat], tools=tools, chat_template=template,
                                            continue_final_message=continue_final_message,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**(defaults or {}), **template_kwargs})
    except jinja2.TemplateError as e:  # the template's raise_exception, or a template that cannot run
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
    except (ValueError, TypeError) as e:  # continue_final_message on a message the template drops
        raise ChatTemplateError(" ".join(str(e).split())) from None
    return rendered[0]
