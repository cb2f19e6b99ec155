"""Token texts as a reader sees them: the characters byte-level tokens make together, invisible ones as marks."""

import codecs
import functools
import json
import re
import unicodedata

from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..decoding import token_text

# the control characters as their pictures (␀ ... ␟, ␡), but newline as ↵ and tab as ⇥
_MARKS = {chr(c): chr(0x2400 + c) for c in range(0x20)} | {"\x7f": "\u2421", "\n": "\u21b5", "\t": "\u21e5"}
_INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")  # controls, bidi and zero-width formats, surrogates, private use
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTES_OF = {ch: b for b, ch in bytes_to_unicode().items()}  # the byte-level alphabet: character -> its byte


def _mark(ch: str) -> str:
    """A character that would be invisible (or turn the text's direction) as a visible mark; others unchanged."""
    return _MARKS.get(ch) or (f"\\u{ord(ch):04x}" if unicodedata.category(ch) in _INVISIBLE else ch)


def label(text: str | None, token: int | None = None) -> str:
    """A token's text as a chip shows it (docs/explorer.md): "∅" when empty, "#id" without a tokenizer's text."""
    if not text:
        return f"#{token}" if text is None else "\u2205"
    core, lead = text.strip(" "), len(text) - len(text.lstrip(" "))
    return "\u2423" * lead + "".join(map(_mark, core)) + "\u2423" * (len(text) - lead - len(core))


def prose(text: str) -> str:
    """A text as running prose shows it: spaces, tabs and newlines as themselves, other invisible characters marked."""
    return "".join(ch if ch in " \n\t" else _mark(ch) for ch in text)


class TokenText:
    """The bytes of each token of one tokenizer (None for a special token) and their texts, computed once each."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)  # its decoder, nested ones included, as JSON
        decoder = json.dumps(json.loads(backend.to_str()).get("decoder")) if backend is not None else ""
        self.byte_level, self.byte_fallback = '"type": "ByteLevel"' in decoder, '"type": "ByteFallback"' in decoder
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.added = {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
        self.bytes = functools.cache(self._bytes)

    def _bytes(self, token: int) -> bytes | None:
        """The token's bytes as the tokenizer's decoder joins them; None for a special token or without a tokenizer."""
        token = int(token)
        if self.tokenizer is None or token in self.special:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token in self.added or not isinstance(piece, str):
            return token_text(self.tokenizer, token).encode("utf-8")
        if self.byte_level and all(ch in _BYTES_OF for ch in piece):
            return bytes(_BYTES_OF[ch] for ch in piece)
        match = _BYTE_FALLBACK.fullmatch(piece) if self.byte_fallback else None
        return bytes([int(match.group(1), 16)]) if match else token_text(self.tokenizer, token).encode("utf-8")

    def text(self, token: int) -> str | None:
        """The token's text alone: its characters, with bytes that make no whole character as \\xNN."""
        if (data := self.bytes(token)) is not None:
            return data.decode("utf-8", errors="backslashreplace")
        return None if self.tokenizer is None else token_text(self.tokenizer, token)

    def whole(self, token: int) -> bool:
        """Whether the token's bytes are whole characters (False for a byte piece of one)."""
        try:
            return (data := self.bytes(token)) is None or data.decode("utf-8") is not None
        except UnicodeDecodeError:
            return False


def unfinished(pieces: list[bytes | None]):
    """For each token, the bytes of a character begun and not finished once it is read (b"" if none, None: special)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for data in pieces:
        if data is None:
            decoder.reset()
            yield None
        else:
            decoder.decode(data)
            yield decoder.getstate()[0]


def char_groups(pieces: list[bytes | None]) -> list[tuple[int, int]]:
    """(first, last) of every run of two or more tokens whose bytes make whole characters only together."""
    groups, start = [], 0
    for i, waiting in enumerate([*unfinished(pieces), None]):  # a special token after the end closes the last run
        if waiting:
            continue
        if (last := i - 1 if waiting is None else i) > start:
            groups.append((start, last))
        start = i + 1
    return groups
