"""Incremental detokenization and stop strings.

A request's text grows token by token: decoding only a short window after the last emitted
point, and holding back text that ends in an incomplete character (U+FFFD), gives the same text
as decoding everything at once, without re-decoding the whole output every step. Stop strings
are matched on that text as it grows (a match may span tokens); the text ends before the match,
as OpenAI's ``stop`` returns it, or after it with vLLM's ``include_stop_str_in_output``. The
tokenizer's ``decode`` options (special tokens skipped or kept, spaces between them) are the
request's."""

from __future__ import annotations

from bi_core.models.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's generated tokens, with its stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), *, include_stop: bool = False,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self._options = {"skip_special_tokens": skip_special_tokens,
                         "spaces_between_special_tokens": spaces_between_special_tokens}
        self.ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._prefix = 0  # ids[_prefix:_read] decode to text already emitted (context for the next token)
        self._read = 0
        self._match = True  # whether the last token's text may hold a stop string (flush's text is its)

    def feed(self, token: int, match: bool = True) -> None:
        """Add one token; ``text`` grows by what it completes; sets ``stop_reason`` on a match
        (``match`` False: none is looked for in what it completes, e.g. before min_tokens)."""
        if self.stop_reason is not None:
            return
        self.ids.append(token)
        self._match = match
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self._add(now[len(before):], match)
            self._prefix, self._read = self._read, len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._options)

    @property
    def settled(self) -> int:
        """How much of ``text`` can no longer be cut by a stop string (stream this much): a kept
        match ends in text that came after it, so with ``include_stop`` none."""
        if not self.stop or self.stop_reason is not None or self.include_stop:
            return len(self.text)
        return max(0, len(self.text) - max(len(s) for s in self.stop) + 1)

    def flush(self) -> None:
        """At the end: text held back for an incomplete character is emitted as it decodes."""
        if self.stop_reason is None and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            self._add(self._decode(self.ids[self._prefix:])[len(before):], self._match)
            self._read = len(self.ids)

    def _add(self, delta: str, match: bool = True) -> None:
        end = len(self.text)
        self.text += delta
        if not match:
            return
        # a match must end in the new text (one that ends before it was refused or not looked for)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, end - len(s) + 1))) >= 0]
        if hits:
            cut, reason = min(hits)
            self.text, self.stop_reason = self.text[:cut + len(reason) if self.include_stop else cut], reason
