"""Tokenizers: the checkpoint's own (transformers AutoTokenizer) or a byte tokenizer for presets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from bi_core.errors import CheckpointError, ConfigError
from bi_core.models import chat_template as templates
from bi_core.models.chat_template import ChatPrompt
from bi_core.models.presets import BYTE_EOS


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` False special tokens stay in it, separated
        by spaces from what is around them where ``spaces_between_special_tokens`` (transformers'
        options: its slow tokenizers honour the second, its fast ones never add such spaces)."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may be part of a UTF-8 character)."""

    def token_name(self, token_id: int) -> str:
        """One token's name in logprobs, distinct for distinct tokens (``name_of``)."""

    def special_ids(self) -> set[int]:
        """The ids of the special tokens (those ``skip_special_tokens`` drops from the text)."""

    def chat(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        """A conversation rendered by the chat template (``tools`` in it, ``template_kwargs`` such as
        ``enable_thinking``) and tokenized, with the token ids that end a turn; raises CheckpointError
        when the tokenizer has no chat template, ChatTemplateError when the template refuses it."""

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a chat template's text: special tokens' names in it are those tokens."""

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or None when the tokenizer has none."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 = <|endoftext|>, 257/258 = im_start/im_end, 259 = pad.

    Its chat template is Qwen3.5's own (``chat_template.qwen3_5_template``: thinking, tools in its
    XML form); ``<think>``, ``<tool_call>`` and the other tags it writes are plain text here (bytes),
    which keeps the presets' vocabulary at 260. A turn ends at ``<|im_end|>``.
    Decoding follows transformers' slow tokenizers: special tokens are skipped, or kept as their
    names, each a piece of its own joined to the text around it by a space unless
    ``spaces_between_special_tokens`` is off."""

    eos_token_id = BYTE_EOS
    im_start, im_end = BYTE_EOS + 1, BYTE_EOS + 2
    special_tokens = {BYTE_EOS: "<|endoftext|>", BYTE_EOS + 1: "<|im_start|>", BYTE_EOS + 2: "<|im_end|>",
                      BYTE_EOS + 3: "<|pad|>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        if skip_special_tokens:  # a skipped token splits nothing: the bytes around it join
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        pieces, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            if run:
                pieces.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            pieces.append(self.special_tokens.get(i, ""))
        if run:
            pieces.append(run.decode("utf-8", errors="replace"))
        return (" " if spaces_between_special_tokens else "").join(pieces)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def token_name(self, token_id: int) -> str:
        return self.special_tokens[token_id] if token_id in self.special_tokens else name_of(self.token_bytes(token_id))

    def special_ids(self) -> set[int]:
        return set(self.special_tokens)

    @property
    def chat_template(self) -> str:
        return templates.qwen3_5_template()

    def encode_rendered(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPECIAL_SPLIT.split(text):
            ids += [_SPECIAL_IDS[piece]] if piece in _SPECIAL_IDS else self.encode(piece)
        return ids

    def chat(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        text = templates.render(self.chat_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    template_kwargs=template_kwargs or {},
                                    defaults={"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"})
        return ChatPrompt(self.encode_rendered(text), text, (self.im_end,))


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - any failure means "this directory has no usable tokenizer"
            raise CheckpointError(f"tokenizer in {path} cannot be loaded: {' '.join(str(e).split())}") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=spaces_between_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """Qwen's tokenizer is byte-level BPE: a token's string maps back to bytes through GPT-2's
        byte-to-unicode table; a token outside it (a special token) is its UTF-8 text."""
        token = self._tok.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        table = _unicode_to_byte()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")

    def token_name(self, token_id: int) -> str:
        return name_of(self.token_bytes(token_id))  # a special token's bytes are its text

    def special_ids(self) -> set[int]:
        decoder = getattr(self._tok, "added_tokens_decoder", {}) or {}
        return {i for i, t in decoder.items() if getattr(t, "special", False)} | set(self._tok.all_special_ids)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one renders conversations
            template = template.get("default")
        return template or None

    def encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)  # transformers splits special tokens out of the text first

    def chat(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        if (template := self.chat_template) is None:
            raise CheckpointError("this checkpoint's tokenizer has no chat template; use /v1/completions")
        text = templates.render(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    template_kwargs=template_kwargs or {}, defaults=self._tok.special_tokens_map)
        end = self._tok.convert_tokens_to_ids("<|im_end|>")
        stops = tuple(i for i in (end, self._tok.eos_token_id) if isinstance(i, int) and i != self._tok.unk_token_id)
        return ChatPrompt(self.encode(text), text, stops)


_SPECIAL_IDS = {name: i for i, name in ByteTokenizer.special_tokens.items()}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(name) for name in _SPECIAL_IDS) + ")")


def name_of(raw: bytes) -> str:
    """A token's name from its bytes: their text when they are whole UTF-8 characters, else
    OpenAI's ``bytes:\\xe2\\x80`` form, so that no two tokens share a name (decoding half a
    character alone gives U+FFFD for all of them, which made the legacy completions' top
    logprobs, a dict by name, lose entries)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable bytes stand for themselves, the others
    are shifted to code points 256 and up."""
    global _BYTE_TABLE
    if _BYTE_TABLE is None:
        keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        table, extra = {chr(b): b for b in keep}, 0
        for b in range(256):
            if b not in keep:
                table[chr(256 + extra)] = b
                extra += 1
        _BYTE_TABLE = table
    return _BYTE_TABLE


_BYTE_TABLE: dict[str, int] | None = None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """The tokenizer in ``path`` if it has one, else None (prompts must then be token ids)."""
    if path is None:
        return None
    p = Path(path)
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return None
    return HFTokenizer(p)


def tokenizer_dir_problem(path: str | Path) -> str | None:
    """Why ``path`` (``model.tokenizer``) cannot hold a tokenizer, or None if it may."""
    p = Path(path)
    if not p.is_dir():
        return f"tokenizer directory {path} {'is not a directory' if p.exists() else 'does not exist'}"
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {path}"
    return None


def tokenizer_for(model) -> Tokenizer | None:
    """The tokenizer an engine of this ``ModelConfig`` uses: ``model.tokenizer`` (which must
    load: it was asked for), else the checkpoint's own (None if it has none), else bytes (random
    presets have no tokenizer files)."""
    if model.tokenizer is None:
        return load_tokenizer(model.path) if model.path else ByteTokenizer()
    if (problem := tokenizer_dir_problem(model.tokenizer)) is not None:
        raise ConfigError("model.tokenizer", problem)
    try:
        return HFTokenizer(model.tokenizer)
    except CheckpointError as e:
        raise ConfigError("model.tokenizer", str(e)) from None
