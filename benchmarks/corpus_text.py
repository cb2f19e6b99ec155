"""The text of the corpora's files, by kind: HTML pages, POD files, the `bible` program's data file, fortune files,
Python modules (docstrings and whole-line comments), Go files (comments). Code (HTML `pre`, POD verbatim paragraphs,
Go's tab-indented comment lines) stays indented, so that the pretraining code's sentence splitter reads prose as
sentences and code a line at a time; paragraphs are separated by a blank line."""

import ast
import html
import io
import itertools
import re
import struct
import subprocess
import textwrap
import tokenize
import warnings
from html.parser import HTMLParser

# a fortune file is one topic, too few documents for the 1-in-20 hold-out: groups of 20 quotes (~3 kB) are enough
# documents that several of each file are held out, and long enough to be more than a line
QUOTES_PER_DOCUMENT = 20
BLOCK_TAGS = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "table",
              "ul", "ol", "dl", "blockquote", "br", "hr", "caption", "figure", "td", "th", "title"}
SKIP_TAGS = {"script", "style", "head", "nav", "noscript", "svg"}
# navigation by class (the last four: the Read the Docs theme's path, page-source link, top bar, previous/next)
SKIP_CLASSES = {"navheader", "navfooter", "toc", "menu", "nav", "navigation", "footer", "header", "sidebar",
                "breadcrumbs", "mainmenu", "menu-bar", "theme-popup",
                "wy-breadcrumbs", "wy-breadcrumbs-aside", "wy-nav-top", "rst-footer-buttons"}
SPHINX_CLASSIC = frozenset({"related", "sphinxsidebar"})
# per package: its theme's navigation, by class or id (Sphinx's classic theme, Publican's)
PACKAGE_SKIP = {"cmake-doc": SPHINX_CLASSIC, "python3.11-doc": SPHINX_CLASSIC,
                "debian-handbook": frozenset({"docnav", "banner"})}
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class _HTMLText(HTMLParser):
    """Paragraphs at block elements, `pre` blocks line by line (indented); scripts, styles, navigation dropped."""

    def __init__(self, skip: frozenset = frozenset()):
        super().__init__(convert_charrefs=True)
        self.skip, self.paragraphs, self.current = skip, [], []
        self.skip_tag, self.skip_depth, self.pre_depth = None, 0, 0  # a skipped element: its tag, how deep it nests

    def _flush(self):
        text = " ".join("".join(self.current).split())
        self.paragraphs += [text] if text else []
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
        elif tag == "pre" or (tag in BLOCK_TAGS and not self.pre_depth):
            self._flush()
            self.pre_depth += tag == "pre"

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if self.skip_depth:
            self.skip_depth -= tag == self.skip_tag
        elif tag == "pre" and self.pre_depth:
            self.pre_depth -= 1
            lines = [line.rstrip() for line in "".join(self.current).expandtabs(4).split("\n") if line.strip()]
            self.paragraphs += ["\n".join("    " + line for line in lines)] if lines else []
            self.current = []
        elif tag in BLOCK_TAGS and not self.pre_depth:
            self._flush()

    def handle_data(self, data):
        if not self.skip_depth:
            self.current.append(data)


def html_to_text(source: str, skip: frozenset = frozenset()) -> str:
    parser = _HTMLText(skip)
    parser.feed(source)
    parser.close()
    parser._flush()
    return "\n\n".join(parser.paragraphs)


_POD_CODE = re.compile(r"([A-Z])<(<+)\s(.*?)\s\2>|([A-Z])<([^<>]*)>", re.S)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_code(match) -> str:
    code, inner = (match.group(1), match.group(3)) if match.group(1) else (match.group(4), match.group(5))
    if code == "E":
        return _POD_ESCAPES.get(inner, html.unescape(f"&{inner};"))
    if code in ("X", "Z"):
        return ""
    if code == "L":
        return inner.split("|", 1)[0] if "|" in inner else inner.replace('"', "").split("/")[-1]
    return inner


def _pod_inline(text: str) -> str:
    """POD formatting codes (B<..>, C<< .. >>, L<text|link>, E<gt>, X<..>) to their plain text, innermost first."""
    for _ in range(4):
        text, before = _POD_CODE.sub(_pod_code, text), text
        if text == before:
            break
    return text


def pod_to_text(source: str) -> str:
    """Headings, =item texts and prose paragraphs (lines joined), verbatim paragraphs indented; other commands go."""
    paragraphs, in_pod, skip_block = [], True, False
    for block in re.split(r"\n[ \t]*\n", source.replace("\r\n", "\n")):
        if not block.strip():
            continue
        if block.startswith("="):
            first = block.split("\n", 1)[0]
            command, _, rest = block.partition(" ") if " " in first else (first, "", "")
            command = command.strip()
            if command in ("=begin", "=end"):
                skip_block = command == "=begin"
            else:
                in_pod = command != "=cut"
            title = _pod_inline(" ".join(rest.split())) if command.startswith("=head") or command == "=item" else ""
            if title and title != "*" and not re.fullmatch(r"\d+\.?", title):
                paragraphs.append(title)
        elif in_pod and not skip_block and block[:1].isspace():  # verbatim (code)
            paragraphs.append("\n".join("    " + line.rstrip()
                                        for line in block.expandtabs(4).split("\n") if line.strip()))
        elif in_pod and not skip_block:
            paragraphs.append(" ".join(_pod_inline(block).split()))
    return "\n\n".join(p for p in paragraphs if p.strip())


def bible_chapters(doc_id: str, data: bytes):
    """(id, text) of every chapter of bible-kjv-text's `bible.data`: "EC02", big-endian uint32s (the segments' count
    at 0x58, one more offsets from 0x5c), the segments (Unix `compress` data less its 3-byte header: gzip reads it),
    64 KiB of text each: a title line, then a verse a line, `Ge1:1 In the beginning ...`. A chapter is a paragraph,
    the references dropped (not language; a verse is often half a sentence)."""
    if not data.startswith(b"EC02"):
        raise SystemExit(f"error: {doc_id} is not the EC02 format this script reads")
    count = struct.unpack_from(">I", data, 0x58)[0]
    offsets = struct.unpack_from(f">{count + 1}I", data, 0x5C)
    text = b"".join(subprocess.run(["gzip", "-dc"], input=b"\x1f\x9d\x90" + data[a:b], capture_output=True,
                                   check=True).stdout for a, b in zip(offsets, offsets[1:])).decode("ascii")
    chapters: dict[str, list[str]] = {}
    for line in text.splitlines()[1:]:
        reference, verse = re.fullmatch(r"(\d?[A-Za-z]+\d+):\d+ (.*)", line).groups()
        chapters.setdefault(reference, []).append(verse)
    for reference, verses in chapters.items():
        yield f"{doc_id}#{reference}", " ".join(verses)


def fortune_groups(doc_id: str, source: str):
    r"""(id, text) of every QUOTES_PER_DOCUMENT quotes of a fortune file (quotes separated by a line `%`), a quote a
    paragraph, its blank lines kept, its lines unindented and their tabs made spaces (the sentence splitter reads an
    all-indented paragraph as code). Old files' terminal overstrikes go: `____\b\b\b\bword` (underlined) and `I\bI`
    (bold) keep what was struck over, `'\be` (an accent) the letter."""
    struck = True
    while struck:
        source, struck = re.subn(r"[^\x08\n]\x08", "", source)
    quotes = [re.sub(r"\n{3,}", "\n\n", "\n".join(" ".join(line.split()) for line in quote.splitlines())).strip()
              for quote in re.split(r"^%[ \t]*$", source.replace("\x08", ""), flags=re.M)]
    quotes = [quote for quote in quotes if quote]
    for start in range(0, len(quotes), QUOTES_PER_DOCUMENT):
        yield f"{doc_id}#{start // QUOTES_PER_DOCUMENT}", "\n\n".join(quotes[start:start + QUOTES_PER_DOCUMENT])


# comments for tools, not readers: shebang, coding line, linters' and formatters' directives, editor settings
_DIRECTIVE = re.compile(r"(!|-\*-|coding[:=]|noqa|type:|pragma|fmt:|pylint:|isort:|mypy:|pyright:|flake8|vim?:)", re.I)
_LICENCE = re.compile(r"copyright|licen[cs]e", re.I)
# legal text inside docstrings and comment blocks (a vendored module's BSD or MIT terms, `License: BSD`)
_LEGAL = re.compile(r"copyright|licen[cs]e|all rights reserved|warrant(y|ies)|redistribut|permission is hereby granted"
                    r"|provided \W?as is", re.I)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # `\f`, `\r` of LaTeX in docstrings that are not raw strings


def _parse(source: str | bytes) -> ast.Module:
    with warnings.catch_warnings():  # old modules' invalid escapes or literals: not ours to report
        warnings.simplefilter("ignore")
        return ast.parse(source)


def _is_code(lines: list[str]) -> bool:
    """Commented-out code: the block parses as Python (wrapped prose almost never does) and is more than one bare
    word (`# Fallback` parses as a name but is prose)."""
    try:
        body = _parse(textwrap.dedent("\n".join(lines))).body
    except (SyntaxError, ValueError):
        return False
    one_word = len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, (ast.Name, ast.Constant))
    return not one_word


def _comment_blocks(tokens, first_code_line: int):
    """(first line, text) of each run of consecutive whole-line `#` comments (trailing comments are fragments about a
    line of code), joined by newlines. Dropped: a directive or a rule (`# ----`, which also ends its run; `#:` marks
    Sphinx's attribute doc), commented-out code, a licence header (copyright or licence above the first statement
    after the module docstring)."""
    blocks, current = [], []  # current: (line number, raw text after `#`, text) of the open run

    def close():
        text = "\n".join(text for _, _, text in current)
        if current and not _is_code([raw for _, raw, _ in current]) and not (
                current[0][0] < first_code_line and _LICENCE.search(text)):
            blocks.append((current[0][0], text))
        current.clear()

    for token in tokens:
        if token.type != tokenize.COMMENT or token.line[:token.start[1]].strip():
            continue
        text = token.string.lstrip("#").lstrip(":").strip()
        text = None if _DIRECTIVE.match(text) or not re.search(r"[A-Za-z]{2}", text) else text
        if current and (text is None or token.start[0] != current[-1][0] + 1):
            close()
        if text is not None:
            current.append((token.start[0], token.string.lstrip("#"), text))
    close()
    return blocks


def _kept(units, seen: set[str]) -> str:
    """The units in order, a blank line between them: their legal paragraphs dropped, those without words or already
    in `seen` (the package's earlier files: generated files, copied docstrings, per-locale boilerplate) left out."""
    kept = []
    for text in units:
        text = "\n\n".join(p for p in re.split(r"\n[ \t]*\n", _CONTROL.sub(" ", text)) if not _LEGAL.search(p))
        if text not in seen and re.search(r"[A-Za-z]{2}", text):
            seen.add(text)
            kept.append(text)
    return "\n\n".join(kept)


def python_text(source: bytes, seen: set[str]) -> str:
    """A module's docstrings (its own, every class's and function's) and comment blocks in order; "" if unparsable."""
    try:
        tree = _parse(source)
        tokens = list(tokenize.tokenize(io.BytesIO(source).readline))
    except (SyntaxError, ValueError, UnicodeDecodeError, tokenize.TokenError, RecursionError, MemoryError):
        return ""
    docstring_line = tree.body[0].lineno if ast.get_docstring(tree) else None
    first_code_line = next((node.lineno for node in tree.body if node.lineno != docstring_line), 1 << 30)
    docstrings = [(node.body[0].lineno, text) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and (text := ast.get_docstring(node, clean=True))]
    units = sorted(docstrings + _comment_blocks(tokens, first_code_line))
    return _kept((text for _, text in units), seen)


_GO_GENERATED = re.compile(rb"^// Code generated .* DO NOT EDIT\.$", re.M)
# `//go:build`, `//go:linkname`, `// +build`, `//line`, `//export`, cgo's `//sys`: for tools, not readers
_GO_DIRECTIVE = re.compile(r"(go:|line |export |sys |\s*\+build)")


def _go_blocks(source: str):
    """Each run of whole-line `//` comments of a Go file, its lines without the `//` (a directive ends a run and is
    dropped; `/* */` comments, in the standard library mostly licences and commented-out code, are left out)."""
    lines = (line.strip() for line in source.splitlines())
    for is_comment, run in itertools.groupby(lines, lambda c: c.startswith("//") and not _GO_DIRECTIVE.match(c[2:])):
        if is_comment:
            yield [comment[2:] for comment in run]


def _go_paragraphs(block: list[str]):
    """A bare `//` separates paragraphs; a line indented past `// ` is code (gofmt's convention: one tab, deeper
    indentation the code's own), kept indented."""
    paragraph, code = [], False
    for line in [*block, ""]:
        line = line[1:] if line.startswith(" ") else line
        is_code = line[:1] in (" ", "\t")
        if not line.strip() or (paragraph and is_code != code):
            yield from ["\n".join(paragraph)] if paragraph else []
            paragraph = []
        if line.strip():
            code = is_code
            paragraph.append("    " + (line[1:] if line[0] == "\t" else line.lstrip(" ")).expandtabs(4).rstrip()
                             if is_code else line.strip())


def go_text(source: bytes, seen: set[str]) -> str:
    """The comment blocks of a Go file in source order; "" for a generated file."""
    if _GO_GENERATED.search(source):
        return ""
    return _kept(("\n\n".join(_go_paragraphs(block)) for block in
                  _go_blocks(_CONTROL.sub(" ", source.decode("utf-8", errors="replace")))), seen)
