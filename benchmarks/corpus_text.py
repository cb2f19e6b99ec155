"""Text of the files the corpora are made of, by kind: HTML pages, POD files, the `bible` program's data file,
fortune files, Python modules (docstrings and whole-line comments), Go files (comments). Code blocks (HTML `pre`, POD
verbatim paragraphs, Go's tab-indented comment lines) are kept indented, so that the pretraining code's sentence
splitter reads prose as sentences and code one line at a time; paragraphs are separated by a blank line."""

from __future__ import annotations

import ast
import html
import io
import re
import struct
import subprocess
import textwrap
import tokenize
import warnings
from html.parser import HTMLParser

# one fortune file is one topic, too few documents for the 1-in-20 hold-out; groups of 20 quotes (~3 kB) are
# enough documents that several of each file are held out, and long enough to be more than a line
QUOTES_PER_DOCUMENT = 20

BLOCK_TAGS = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "table",
              "ul", "ol", "dl", "blockquote", "br", "hr", "caption", "figure", "td", "th", "title"}
SKIP_TAGS = {"script", "style", "head", "nav", "noscript", "svg"}
# (the last four: the Read the Docs theme's path, page-source link, top bar and previous/next buttons)
SKIP_CLASSES = {"navheader", "navfooter", "toc", "menu", "nav", "navigation", "footer", "header", "sidebar",
                "breadcrumbs", "mainmenu", "menu-bar", "theme-popup",
                "wy-breadcrumbs", "wy-breadcrumbs-aside", "wy-nav-top", "rst-footer-buttons"}
# per package: the navigation of its theme, by class or id (Sphinx's classic theme, Publican's)
SPHINX_CLASSIC = frozenset({"related", "sphinxsidebar"})
PACKAGE_SKIP = {"cmake-doc": SPHINX_CLASSIC, "python3.11-doc": SPHINX_CLASSIC,
                "debian-handbook": frozenset({"docnav", "banner"})}
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class _HTMLText(HTMLParser):
    """Text of an HTML page: paragraphs at block elements, `pre` blocks kept line by line (indented), scripts,
    styles and navigation (by tag or class) dropped."""

    def __init__(self, skip: frozenset = frozenset()):
        super().__init__(convert_charrefs=True)
        self.skip = skip  # the package's own: classes or ids
        self.paragraphs: list[str] = []
        self.current: list[str] = []
        self.skip_tag, self.skip_depth = None, 0  # inside a skipped element: its tag and how deep it nests
        self.pre_depth = 0

    def _flush(self):
        text = " ".join("".join(self.current).split())
        if text:
            self.paragraphs.append(text)
        self.current = []

    def handle_starttag(self, tag, attrs):
        if tag in VOID_TAGS:
            if tag == "br" and not self.skip_depth:
                self._flush() if not self.pre_depth else self.current.append("\n")
            return
        if self.skip_depth:  # only the skipped tag's own nesting counts (pages leave <p>, <li> unclosed)
            self.skip_depth += tag == self.skip_tag
            return
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        if tag in SKIP_TAGS or classes & SKIP_CLASSES or (classes | {attrs.get("id")}) & self.skip:
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self._flush()
            self.pre_depth += 1
        elif tag in BLOCK_TAGS and not self.pre_depth:
            self._flush()

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if self.skip_depth:
            self.skip_depth -= tag == self.skip_tag
            return
        if tag == "pre" and self.pre_depth:
            self.pre_depth -= 1
            lines = [line.rstrip() for line in "".join(self.current).expandtabs(4).split("\n")]
            lines = [line for line in lines if line.strip()]
            if lines:
                self.paragraphs.append("\n".join("    " + line for line in lines))
            self.current = []
        elif tag in BLOCK_TAGS and not self.pre_depth:
            self._flush()

    def handle_data(self, data):
        if not self.skip_depth:
            self.current.append(data)

    def text(self) -> str:
        self._flush()
        return "\n\n".join(self.paragraphs)


def html_to_text(source: str, skip: frozenset = frozenset()) -> str:
    parser = _HTMLText(skip)
    parser.feed(source)
    parser.close()
    return parser.text()


_POD_CODE = re.compile(r"([A-Z])<(<+)\s(.*?)\s\2>|([A-Z])<([^<>]*)>", re.S)


def _pod_inline(text: str) -> str:
    """POD formatting codes (B<..>, C<< .. >>, L<text|link>, E<gt>, X<..>) to their plain text."""
    def replace(match):
        code = match.group(1) or match.group(4)
        inner = match.group(3) if match.group(1) else match.group(5)
        if code == "E":
            return {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}.get(inner, html.unescape(f"&{inner};"))
        if code in ("X", "Z"):
            return ""
        if code == "L":
            label = inner.split("|", 1)[0] if "|" in inner else inner
            return label.replace('"', "").split("/")[-1] if "|" not in inner else label
        return inner

    for _ in range(4):  # nested codes: innermost first
        new = _POD_CODE.sub(replace, text)
        if new == text:
            break
        text = new
    return text


def pod_to_text(source: str) -> str:
    """Text of a POD document: headings and prose paragraphs (wrapped lines joined), verbatim paragraphs indented
    line by line; other commands (=over, =item markers, =begin/=end blocks, =cut) dropped."""
    paragraphs, in_pod, skip_block = [], True, False
    for block in re.split(r"\n[ \t]*\n", source.replace("\r\n", "\n")):
        if not block.strip():
            continue
        if block.startswith("="):
            command, _, rest = (block.partition(" ") if " " in block.split("\n", 1)[0]
                                else (block.split("\n", 1)[0], "", ""))
            command = command.strip()
            if command == "=cut":
                in_pod = False
            elif command == "=begin":
                skip_block = True
            elif command == "=end":
                skip_block = False
            elif command.startswith("=head") or command == "=item":
                in_pod = True
                title = _pod_inline(" ".join(rest.split()))
                if title and title not in ("*",) and not re.fullmatch(r"\d+\.?", title):
                    paragraphs.append(title)
            else:
                in_pod = True
            continue
        if not in_pod or skip_block:
            continue
        if block[:1].isspace():  # verbatim (code)
            lines = [line.rstrip() for line in block.expandtabs(4).split("\n") if line.strip()]
            paragraphs.append("\n".join("    " + line.strip("\n") for line in lines))
        else:
            paragraphs.append(" ".join(_pod_inline(block).split()))
    return "\n\n".join(p for p in paragraphs if p.strip())


LZW_MAGIC = b"\x1f\x9d\x90"  # Unix `compress` header: block mode, codes of up to 16 bits


def _uncompress(data: bytes) -> bytes:
    """Data in Unix `compress` (.Z, LZW) format: Python's standard library has no LZW, gzip reads it."""
    return subprocess.run(["gzip", "-dc"], input=data, capture_output=True, check=True).stdout


def bible_chapters(doc_id: str, data: bytes):
    """(id, text) of every chapter of bible-kjv-text's `bible.data` (the `bible` program's own format): "EC02", a
    description, then big-endian uint32s (the number of segments at 0x58, one more offsets from 0x5c) and the
    segments, each Unix `compress` data without its 3-byte header and 64 KiB of text once uncompressed. The text
    has a title line then one verse a line, `Ge1:1 In the beginning ...`; a chapter's verses become one paragraph
    (the references dropped: they are not language, and a verse is often half a sentence)."""
    if not data.startswith(b"EC02"):
        raise SystemExit(f"error: {doc_id} is not the EC02 format this script reads")
    count = struct.unpack_from(">I", data, 0x58)[0]
    offsets = struct.unpack_from(f">{count + 1}I", data, 0x5C)
    text = b"".join(_uncompress(LZW_MAGIC + data[a:b]) for a, b in zip(offsets, offsets[1:])).decode("ascii")
    chapters: dict[str, list[str]] = {}
    for line in text.splitlines()[1:]:
        reference, verse = re.fullmatch(r"(\d?[A-Za-z]+\d+):\d+ (.*)", line).groups()
        chapters.setdefault(reference, []).append(verse)
    for reference, verses in chapters.items():
        yield f"{doc_id}#{reference}", " ".join(verses)


def _unstrike(text: str) -> str:
    r"""Text without the terminal overstrikes of old fortune files: `____\b\b\b\bword` (underlined) and `I\bI` (bold)
    keep what was struck over, `'\be` (an accent) the letter."""
    while True:
        new = re.sub(r"[^\x08\n]\x08", "", text)
        if new == text:
            return new.replace("\x08", "")
        text = new


def fortune_groups(doc_id: str, source: str):
    """(id, text) of every QUOTES_PER_DOCUMENT consecutive quotes of a fortune file (strfile source: quotes
    separated by a line holding `%`). A quote is a paragraph, its blank lines kept as paragraph breaks; lines are
    unindented and their tabs made spaces, since the sentence splitter reads an all-indented paragraph (a
    tab-indented quote) as code, one line at a time."""
    quotes = []
    for quote in re.split(r"^%[ \t]*$", _unstrike(source), flags=re.M):
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(" ".join(line.split()) for line in quote.splitlines())).strip()
        if text:
            quotes.append(text)
    for start in range(0, len(quotes), QUOTES_PER_DOCUMENT):
        yield f"{doc_id}#{start // QUOTES_PER_DOCUMENT}", "\n\n".join(quotes[start:start + QUOTES_PER_DOCUMENT])


# comments for tools, not readers: shebang, coding line, linters' and formatters' directives, editor settings
_DIRECTIVE = re.compile(r"(!|-\*-|coding[:=]|noqa|type:|pragma|fmt:|pylint:|isort:|mypy:|pyright:|flake8|vim?:)",
                        re.I)
_LICENCE = re.compile(r"copyright|licen[cs]e", re.I)
# legal text inside docstrings and later comment blocks (a vendored module's BSD or MIT terms, `License: BSD`)
_LEGAL = re.compile(r"copyright|licen[cs]e|all rights reserved|warrant(y|ies)|redistribut|permission is hereby granted"
                    r"|provided \W?as is", re.I)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # `\f`, `\r` of LaTeX in docstrings that are not raw strings


def _parse(source: str | bytes) -> ast.Module:
    with warnings.catch_warnings():  # invalid escape sequences or literals in old modules, in comments: not ours
        warnings.simplefilter("ignore")
        return ast.parse(source)


def _comment_text(token: str) -> str | None:
    """Text of a `#` comment line, or None for a directive or a rule (`# ------`) that carries no words."""
    text = token.lstrip("#").lstrip(":").strip()  # `#:` marks an attribute's doc comment for Sphinx
    if _DIRECTIVE.match(text) or not re.search(r"[A-Za-z]{2}", text):
        return None
    return text


def _is_code(lines: list[str]) -> bool:
    """Whether a comment block is commented-out code: it parses as Python (wrapped prose almost never does) and is
    more than one bare word (`# Fallback` parses as a name but is prose)."""
    try:
        tree = _parse(textwrap.dedent("\n".join(lines)))
    except (SyntaxError, ValueError):
        return False
    body = tree.body
    one_word = len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, (ast.Name, ast.Constant))
    return not one_word


def _comment_blocks(tokens, first_code_line: int):
    """(first line, text) of each block of consecutive whole-line `#` comments (trailing comments are left out:
    they are fragments about one line of code), lines joined by newlines. Dropped: a directive or rule line (which
    also ends its block), commented-out code, and a licence header (a block mentioning copyright or licence above
    the first statement after the module docstring)."""
    blocks, current = [], []  # current: (line number, raw text after `#`, text) of the open block

    def close():
        if current and not _is_code([raw for _, raw, _ in current]):
            text = "\n".join(text for _, _, text in current)
            if not (current[0][0] < first_code_line and _LICENCE.search(text)):
                blocks.append((current[0][0], text))
        current.clear()

    for token in tokens:
        if token.type != tokenize.COMMENT or token.line[:token.start[1]].strip():
            continue
        text = _comment_text(token.string)
        if current and (text is None or token.start[0] != current[-1][0] + 1):
            close()
        if text is not None:
            current.append((token.start[0], token.string.lstrip("#"), text))
    close()
    return blocks


def _docstrings(tree: ast.Module):
    """(line, text) of the module's, every class's and every function's docstring (cleaned: indentation removed)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield node.body[0].lineno, text


def python_text(source: bytes, seen: set[str]) -> str:
    """The docstrings and comment blocks of a Python module in source order, a blank line between them; "" if it
    does not parse. Paragraphs of legal text are dropped; a docstring or comment block already in `seen` (the
    package's earlier modules: generated files, copied docstrings, per-locale boilerplate) is left out, so
    repeated text is kept once."""
    try:
        tree = _parse(source)
        tokens = list(tokenize.tokenize(io.BytesIO(source).readline))
    except (SyntaxError, ValueError, UnicodeDecodeError, tokenize.TokenError, RecursionError, MemoryError):
        return ""
    docstring_line = tree.body[0].lineno if ast.get_docstring(tree) else None
    first_code_line = next((node.lineno for node in tree.body if node.lineno != docstring_line), 1 << 30)
    units = sorted([*_docstrings(tree), *_comment_blocks(tokens, first_code_line)])
    kept = []
    for _, text in units:
        paragraphs = re.split(r"\n[ \t]*\n", _CONTROL.sub(" ", text))
        text = "\n\n".join(paragraph for paragraph in paragraphs if not _LEGAL.search(paragraph))
        if text not in seen and re.search(r"[A-Za-z]{2}", text):
            seen.add(text)
            kept.append(text)
    return "\n\n".join(kept)


_GO_GENERATED = re.compile(rb"^// Code generated .* DO NOT EDIT\.$", re.M)
# `//go:build`, `//go:linkname`, `// +build`, `//line`, `//export`, cgo's `//sys`: for tools, not readers
_GO_DIRECTIVE = re.compile(r"(go:|line |export |sys |\s*\+build)")


def _go_blocks(source: str):
    """Each run of consecutive whole-line `//` comments of a Go file, as lines without the `//` (a directive line
    ends a run and is dropped; `/* */` comments, in the standard library mostly licence headers and commented-out
    code, are left out)."""
    block = []
    for line in source.splitlines():
        comment = line.strip()
        if comment.startswith("//") and not _GO_DIRECTIVE.match(comment[2:]):
            block.append(comment[2:])
        elif block:
            yield block
            block = []
    if block:
        yield block


def _go_paragraphs(block: list[str]):
    """Paragraphs of a Go comment block: a bare `//` separates them, and a line indented past `// ` is code
    (gofmt's doc comment convention), kept indented as the HTML and POD readers keep code."""
    paragraph, code = [], False
    for line in [*block, ""]:
        line = line[1:] if line.startswith(" ") else line
        is_code = line[:1] in (" ", "\t")
        if not line.strip() or (paragraph and is_code != code):
            if paragraph:
                yield "\n".join(paragraph)
            paragraph = []
        if line.strip():
            code = is_code
            if is_code:  # gofmt's one tab marks code; deeper indentation is the code's own
                paragraph.append("    " + (line[1:] if line[0] == "\t" else line.lstrip(" ")).expandtabs(4).rstrip())
            else:
                paragraph.append(line.strip())


def go_text(source: bytes, seen: set[str]) -> str:
    """The comment blocks of a Go file in source order, a blank line between them; "" for a generated file. Legal
    paragraphs, blocks without words and blocks already in `seen` are dropped, as for Python."""
    if _GO_GENERATED.search(source):
        return ""
    kept = []
    for block in _go_blocks(_CONTROL.sub(" ", source.decode("utf-8", errors="replace"))):
        text = "\n\n".join(p for p in _go_paragraphs(block) if not _LEGAL.search(p))
        if text not in seen and re.search(r"[A-Za-z]{2}", text):
            seen.add(text)
            kept.append(text)
    return "\n\n".join(kept)
