"""Token texts as a reader sees them: a token's bytes, UTF-8 characters that span several tokens, visible escapes.

Byte-level BPE tokenizers (GPT-2's scheme, the demo's and BriLLM0.5's English one) give every token a run of bytes;
a character outside ASCII (é, 中, 😀) is two to four bytes and often spans tokens, so decoding each token alone
shows "�". The page shows such tokens as the character they make together (`char_groups`), each token's own bytes
as \\xNN escapes, and every invisible character as a visible mark (`label`).
"""

from __future__ import annotations

import codecs
import json
import re
import unicodedata

_WHITESPACE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}
_INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")  # controls, bidi and zero-width formats, surrogates, private use
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _escape(ch: str) -> str:
    """A character that would be invisible (or change the text's direction) as a visible mark; others unchanged."""
    if ord(ch) < 0x20:
        return chr(0x2400 + ord(ch))  # the C0 control pictures: ␀ ... ␟
    if ch == "\x7f":
        return "\u2421"
    if unicodedata.category(ch) in _INVISIBLE or ch in "\u2028\u2029\ufeff":
        return f"\\u{ord(ch):04x}"
    return ch


def label(text: str | None, token: int | None = None) -> str:
    """A token's text as a chip shows it: newline ↵, tab ⇥, other controls as their control pictures, bidi and
    zero-width characters as \\uXXXX, a space at either end (or a token of spaces) as ␣, "∅" for an empty text and
    "#id" when no tokenizer gave a text."""
    if text is None:
        return f"#{token}"
    if text == "":
        return "\u2205"
    lead, trail = len(text) - len(text.lstrip(" ")), len(text.rstrip(" "))
    out = []
    for i, ch in enumerate(text):
        if ch == " ":
            out.append("\u2423" if i < lead or i >= trail else " ")
        else:
            out.append(_WHITESPACE.get(ch) or _escape(ch))
    return "".join(out)


def prose(text: str) -> str:
    """A text as running prose shows it: spaces, tabs and newlines as themselves, every other invisible character
    as the visible mark `label` gives it."""
    return "".join(ch if ch in " \n\t" else _WHITESPACE.get(ch) or _escape(ch) for ch in text)


def decode(data: bytes) -> str:
    """Bytes as text: valid UTF-8 as its characters, every byte that is not part of one as \\xNN."""
    return data.decode("utf-8", errors="backslashreplace")


def _byte_table() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode), inverted: the character a byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTES_OF = _byte_table()


def _decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    found, stack = set(), [json.loads(backend.to_str()).get("decoder")]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.add(node.get("type"))
            stack.extend(node.get("decoders") or [])
    return found


class TokenText:
    """The bytes of each token of one tokenizer (None for a special token) and their texts, computed once each."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer) if tokenizer is not None else set()
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.added = {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
        self._bytes: dict[int, bytes | None] = {}

    def _decoded(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def bytes(self, token: int) -> bytes | None:
        """The token's bytes as the tokenizer's decoder joins them; None for a special token or without a tokenizer."""
        token = int(token)
        if token not in self._bytes:
            self._bytes[token] = self._compute(token)
        return self._bytes[token]

    def _compute(self, token: int) -> bytes | None:
        if self.tokenizer is None or token in self.special:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token in self.added or not isinstance(piece, str):
            return self._decoded(token).encode("utf-8")
        if self.byte_level and all(ch in _BYTES_OF for ch in piece):
            return bytes(_BYTES_OF[ch] for ch in piece)
        match = _BYTE_FALLBACK.fullmatch(piece) if self.byte_fallback else None
        if match:
            return bytes([int(match.group(1), 16)])
        return self._decoded(token).encode("utf-8")

    def text(self, token: int) -> str | None:
        """The token's text alone: its characters, with bytes that make no whole character as \\xNN."""
        data = self.bytes(token)
        if data is not None:
            return decode(data)
        return None if self.tokenizer is None else self._decoded(int(token))

    def whole(self, token: int) -> bool:
        """Whether the token's bytes are whole characters (False for a byte piece of one)."""
        data = self.bytes(token)
        if data is None:
            return True
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True


def char_groups(pieces: list[bytes | None]) -> list[tuple[int, int]]:
    """The runs of two or more consecutive tokens whose bytes make whole characters only together: (first, last)
    token indices, inclusive. A special token (None) ends a run; a run still open at the end is closed there."""
    groups, start = [], 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, data in enumerate(pieces):
        if data is None:
            if i - 1 > start:
                groups.append((start, i - 1))
            decoder.reset()
            start = i + 1
            continue
        decoder.decode(data)
        if decoder.getstate()[0] == b"":  # no bytes left waiting for the rest of a character
            if i > start:
                groups.append((start, i))
            start = i + 1
    if len(pieces) - 1 > start:
        groups.append((start, len(pieces) - 1))
    return groups


def pending(pieces: list[bytes | None]) -> list[bytes]:
    """For each token index, the bytes of a character begun but not finished once that token is read (b"" when the
    text stands at a character boundary): what the next token completes."""
    out, decoder = [], codecs.getincrementaldecoder("utf-8")(errors="replace")
    for data in pieces:
        if data is None:
            decoder.reset()
        else:
            decoder.decode(data)
        out.append(decoder.getstate()[0])
    return out
