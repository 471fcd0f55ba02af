"""Tokenizers: the checkpoint's own (transformers AutoTokenizer) or a byte tokenizer for presets."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from bi_core.errors import CheckpointError, ConfigError
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

    def chat(self, messages: list[dict[str, str]]) -> tuple[list[int], tuple[int, ...]]:
        """A conversation as prompt ids ending in the assistant's turn, and the token ids that end
        a turn; raises CheckpointError when the tokenizer has no chat template."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 = <|endoftext|>, 257/258 = im_start/im_end, 259 = pad.

    Its chat template is plain ChatML, the format of Qwen's own: for each message
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``; a turn ends at
    ``<|im_end|>``. Decoding follows transformers' slow tokenizers: special tokens are skipped, or
    kept as their names, each a piece of its own joined to the text around it by a space unless
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

    def chat(self, messages: list[dict[str, str]]) -> tuple[list[int], tuple[int, ...]]:
        ids: list[int] = []
        for m in messages:
            ids += [self.im_start, *self.encode(f"{m['role']}\n{m['content']}"), self.im_end, *self.encode("\n")]
        return ids + [self.im_start, *self.encode("assistant\n")], (self.im_end,)


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

    def chat(self, messages: list[dict[str, str]]) -> tuple[list[int], tuple[int, ...]]:
        if not getattr(self._tok, "chat_template", None):
            raise CheckpointError("this checkpoint's tokenizer has no chat template; use /v1/completions")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        end = self._tok.convert_tokens_to_ids("<|im_end|>")
        stops = tuple(i for i in (end, self._tok.eos_token_id) if isinstance(i, int) and i != self._tok.unk_token_id)
        return self.encode(text), stops


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
