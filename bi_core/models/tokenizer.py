"""Tokenizers: the checkpoint's own (transformers AutoTokenizer) or a byte tokenizer for presets."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from bi_core.errors import CheckpointError
from bi_core.models.presets import BYTE_EOS


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 = <|endoftext|>, 257/258 = im_start/im_end, 259 = pad."""

    eos_token_id = BYTE_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - any failure means "this directory has no usable tokenizer"
            raise CheckpointError(f"tokenizer in {path} cannot be loaded: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """The tokenizer in ``path`` if it has one, else None (prompts must then be token ids)."""
    if path is None:
        return None
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    return HFTokenizer(p)
