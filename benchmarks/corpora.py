"""Offline text corpora for the quality benchmarks: Debian packages turned into plain text of four kinds.

    python benchmarks/corpora.py --output_dir outputs/corpora            # every corpus (needs apt-get, dpkg-deb)
    python benchmarks/corpora.py --corpus small --output_dir outputs/corpora

Why these: the embedded pydoc corpus is too small to rank recipes (every model overfits it within a minute), and
the only reachable sources here are package registries. `apt-get download` fetches a `.deb` without installing it
and `dpkg-deb -x` unpacks it; every package used is in Debian main (public domain, GPL, BSD, PSF, PostgreSQL,
Artistic, MIT or Apache licences: all redistributable). Nothing is committed: this script rebuilds the same files.
Four kinds, so that a recipe is ranked on more than one register of English:

    documentation (one HTML page or one POD file a document)
    small        git's manual pages and user manual (git-doc): ~3 MB of training text
    large        small + PostgreSQL 15 manual, Perl's pod documentation, SQLite's documentation, the Debian
                 reference, policy and developers' reference, bash and gnuplot manuals: >= 20 MB of training text

    literature (one Bible chapter, or 20 consecutive quotes of one fortune file, a document)
    literature   the King James Bible (bible-kjv-text; the translation is public domain) and quotations from the
                 fortune cookie files (fortunes-min; fortunes' people, wisdom, humorists and love files): ~4.3 MB
                 of training text, 92% of it the Bible

    code (the docstrings and whole-line `#` comments of one Python module a document, without the code; legal
          paragraphs, commented-out code and text repeated within a package left out)
    code         CPython 3.11's standard library as Debian ships it (libpython3.11-minimal, -stdlib,
                 python3-distutils, -lib2to3, -tk, idle-python3.11): ~2.6 MB of training text
    code-large   code + SymPy, NumPy, SciPy, pandas, matplotlib, Django, scikit-learn and NetworkX: ~25 MB of
                 training text
    code-django  Django and NetworkX: ~2.7 MB of training text
    code-plots   Matplotlib and NetworkX: ~3.5 MB of training text (the last two: corpora the default recipe was
                 not tuned on, each a slice of code-large split as it splits them)

    books (one page of an mdBook book a document)
    rust-books   the Rust project's books as Debian ships them (rust-doc): The Rust Programming Language, the
                 Reference, the Rustonomicon, Rust by Example, the Edition Guide, the Embedded Rust book and the
                 rustc book; tutorial prose with many code listings: ~2.9 MB of training text

    code-go      the doc comments and whole-line `//` comments of Go 1.19's standard library (golang-1.19-src;
                 one file a document; no tests, test data, vendored modules or toolchain commands): ~3.8 MB of
                 training text (the last two: built after the default recipe's other choices, to check it on text
                 it was not tuned on)

    linux-docs   the Linux kernel's documentation as Debian ships it (linux-doc-6.1; one Sphinx page a
                 document; English only): administration and driver guides, subsystem and API references
                 (kernel-doc comments rendered), process documents: ~30 MB of training text (built after every
                 choice of the default recipe, a large corpus none was tuned on)

    cmake-docs   CMake's reference documentation (cmake-doc; one Sphinx page a document: commands, variables,
                 properties, modules, policies, manuals): ~3 MB of training text
    handbook-de  The Debian Administrator's Handbook in German (debian-handbook, de-DE; one page a document; its
                 command output and the passages not yet translated are English): ~0.9 M characters of training
                 text (the last two built for the recipe's ablation, no rule tuned on them)

Every 20th document by a hash of its id (its path; `#chapter` or `#group` added where one file holds many
documents) is held out, so train and validation never share a page, a chapter, a group of quotes or a module.

Each corpus is written as `<name>/train.jsonl` and `<name>/validation.jsonl`, one `{"text": ..., "source": ...}`
record per document; paragraphs are separated by a blank line and code blocks (HTML `pre`, POD verbatim paragraphs,
Go's tab-indented comment lines) are indented, so the pretraining code's sentence splitter
(`training.data.split_sentences`) reads prose as sentences and code one line at a time. `<name>/stats.json` records
the packages (name and version), the document counts and the sizes. Use with `--train_file <dir>/train.jsonl
--validation_file <dir>/validation.jsonl`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import html
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import textwrap
import tokenize
import urllib.parse
import warnings
from html.parser import HTMLParser
from pathlib import Path

# package -> which of its files are documents (glob under the unpacked tree)
DOC_PACKAGES = {
    "git-doc": ["usr/share/doc/git-doc/**/*.html"],
    "postgresql-doc-15": ["usr/share/doc/postgresql-doc-15/html/*.html"],
    "perl-doc": ["usr/share/perl/*/pod/*.pod"],
    "sqlite3-doc": ["usr/share/doc/sqlite3/**/*.html"],
    "debian-reference-en": ["usr/share/debian-reference/**/*.html"],
    "debian-policy": ["usr/share/doc/debian-policy/policy.html/*.html"],
    "developers-reference": ["usr/share/developers-reference/**/*.html"],
    "bash-doc": ["usr/share/doc/bash/**/*.html"],
    "gnuplot-doc": ["usr/share/doc/gnuplot/htmldocs/*.html"],
}
RUST_DOC = "usr/share/doc/rust-doc/html/"
# the Rust project's mdBook books (not the API reference, which is code comments); of The Rust Programming Language
# only the current edition's chapters: the older editions' pages are the same text again, or stubs pointing to it
BOOK_PACKAGES = {
    "rust-doc": [RUST_DOC + "book/" + page for page in ("ch*.html", "appendix-*.html", "foreword.html")]
                + [RUST_DOC + book + "/**/*.html" for book in ("reference", "nomicon", "rust-by-example",
                                                               "edition-guide", "embedded-book", "rustc")],
}
FORTUNES = "usr/share/games/fortunes/"
LITERATURE_PACKAGES = {
    "bible-kjv-text": ["usr/lib/bible.data"],
    "fortunes-min": [FORTUNES + name for name in ("fortunes", "literature", "riddles")],
    # quotations of named people; not the jokes, ASCII art, song lyrics or Unix lore of the other files, and not
    # the fortunes-off package
    "fortunes": [FORTUNES + name for name in ("people", "wisdom", "humorists", "love")],
}
STDLIB = "usr/lib/python3.11/**/*.py"
SITE = "usr/lib/python3/dist-packages/"
# Debian splits CPython 3.11's standard library over these six packages (its tests, left out, over more)
STDLIB_PACKAGES = ["libpython3.11-minimal", "libpython3.11-stdlib", "python3-distutils", "python3-lib2to3",
                   "python3-tk", "idle-python3.11"]
CODE_PACKAGES = {
    **{package: [STDLIB] for package in STDLIB_PACKAGES},
    "python3-sympy": [SITE + "sympy/**/*.py"],
    "python3-numpy": [SITE + "numpy/**/*.py"],
    "python3-scipy": [SITE + "scipy/**/*.py"],
    "python3-pandas": [SITE + "pandas/**/*.py"],
    "python3-matplotlib": [SITE + "matplotlib/**/*.py", SITE + "mpl_toolkits/**/*.py"],
    "python3-django": [SITE + "django/**/*.py"],
    "python3-sklearn": [SITE + "sklearn/**/*.py"],
    "python3-networkx": [SITE + "networkx/**/*.py"],
}
GO_PACKAGES = {"golang-1.19-src": ["usr/share/go-1.19/src/**/*.go"]}
KERNEL_PACKAGES = {"linux-doc-6.1": ["usr/share/doc/linux-doc-6.1/html/**/*.html"]}
REFERENCE_PACKAGES = {"cmake-doc": ["usr/share/doc/cmake-data/html/**/*.html"]}
GERMAN_PACKAGES = {"debian-handbook": ["usr/share/doc/debian-handbook/html/de-DE/*.html"]}
PACKAGES = {**DOC_PACKAGES, **BOOK_PACKAGES, **LITERATURE_PACKAGES, **CODE_PACKAGES, **GO_PACKAGES,
            **KERNEL_PACKAGES, **REFERENCE_PACKAGES, **GERMAN_PACKAGES}
# files matched above that are no document of their own: mdBook's page that repeats a whole book (kept, it would
# put every held-out chapter in the training text), Go's tests, test data, vendored copies of other modules and
# the toolchain's commands (the standard library is the corpus, as CPython's is for `code`), and the kernel
# documentation's translations (not English), Sphinx's index and search pages and its copies of the sources
LEFT_OUT = re.compile(r"/print\.html$|_test\.go$|/testdata/|/vendor/|/go-1\.19/src/cmd/"
                      r"|/linux-doc-6\.1/html/(translations/|_sources/|_static/|genindex\.html$|search\.html$)"
                      r"|/cmake-data/html/(_sources/|_static/|genindex\.html$|search\.html$)")
CORPORA = {
    "small": ["git-doc"],
    "large": list(DOC_PACKAGES),
    "literature": list(LITERATURE_PACKAGES),
    "code": STDLIB_PACKAGES,
    "code-large": list(CODE_PACKAGES),
    "code-django": ["python3-django", "python3-networkx"],
    "code-plots": ["python3-matplotlib", "python3-networkx"],
    "rust-books": list(BOOK_PACKAGES),
    "code-go": list(GO_PACKAGES),
    "linux-docs": list(KERNEL_PACKAGES),
    "cmake-docs": list(REFERENCE_PACKAGES),
    "handbook-de": list(GERMAN_PACKAGES),
}
HOLD_OUT_EVERY = 20
MIN_DOCUMENT_CHARS = 200  # index pages, redirects and empty stubs carry no language
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
PACKAGE_SKIP = {"cmake-doc": frozenset({"related", "sphinxsidebar"}),
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


def held_out(document_id: str) -> bool:
    """Every HOLD_OUT_EVERY-th document, chosen by a hash of its path (stable across rebuilds and orderings)."""
    return int(hashlib.sha1(document_id.encode()).hexdigest(), 16) % HOLD_OUT_EVERY == 0


def fetch_package(package: str, workdir: Path) -> tuple[Path, str]:
    """(unpacked tree, version) of a Debian package: `apt-get download` then `dpkg-deb -x` (nothing installed)."""
    tree = workdir / package
    debs = workdir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        result = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if result.returncode != 0 or not found:
            raise SystemExit(f"error: apt-get download {package} failed ({result.stderr.strip().splitlines()[-1:]}); "
                             "run `apt-get update` first, or check that Debian's archive is reachable.")
    deb = found[-1]
    if not tree.is_dir():
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    version = urllib.parse.unquote(deb.name.split("_")[1])
    return tree, version


def file_documents(doc_id: str, path: Path, seen: set[str], skip: frozenset = frozenset()):
    """(document id, text) of the documents in one file, read by its kind: a Python module, the Bible's data file,
    a fortune file (no suffix), a POD file or an HTML page."""
    if path.suffix == ".py":
        yield doc_id, python_text(path.read_bytes(), seen)
    elif path.suffix == ".go":
        yield doc_id, go_text(path.read_bytes(), seen)
    elif path.name == "bible.data":
        yield from bible_chapters(doc_id, path.read_bytes())
    else:
        raw = path.read_bytes().decode("utf-8", errors="replace")
        if not path.suffix:
            yield from fortune_groups(doc_id, raw)
        else:
            yield doc_id, pod_to_text(raw) if path.suffix == ".pod" else html_to_text(raw, skip)


def documents(package: str, tree: Path):
    """(document id, text) of every document of an unpacked package, sorted by path."""
    paths = sorted({p for pattern in PACKAGES[package] for p in tree.glob(pattern)
                    if p.is_file() and not LEFT_OUT.search(f"/{p.relative_to(tree).as_posix()}")})
    seen: set[str] = set()  # the package's docstrings and comment blocks so far
    pages: set[str] = set()  # a book's pages so far: mdBook's index.html is the first chapter again
    skip = PACKAGE_SKIP.get(package, frozenset())
    for path in paths:
        for doc_id, text in file_documents(f"{package}/{path.relative_to(tree)}", path, seen, skip):
            if len(text) < MIN_DOCUMENT_CHARS:
                continue
            if package in BOOK_PACKAGES:
                if text in pages:
                    continue
                pages.add(text)
            yield doc_id, text


@functools.lru_cache(maxsize=None)
def package_documents(package: str, workdir: Path) -> tuple[str, list[tuple[str, str]]]:
    """(version, documents) of a package, read once per run: `all` builds corpora that share packages."""
    tree, version = fetch_package(package, workdir)
    return version, list(documents(package, tree))


def build(name: str, output_dir: Path, workdir: Path) -> dict:
    folder = output_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    stats = dict(corpus=name, packages={}, hold_out=f"every {HOLD_OUT_EVERY}th document by sha1 of its id",
                 train_documents=0, validation_documents=0, train_chars=0, validation_chars=0)
    tmp = {split: folder / f".tmp-{split}.jsonl" for split in ("train", "validation")}
    handles = {split: open(path, "w", encoding="utf-8") for split, path in tmp.items()}
    try:
        for package in CORPORA[name]:
            version, docs = package_documents(package, workdir)
            for doc_id, text in docs:
                split = "validation" if held_out(doc_id) else "train"
                handles[split].write(json.dumps({"text": text, "source": doc_id}, ensure_ascii=False) + "\n")
                stats[f"{split}_documents"] += 1
                stats[f"{split}_chars"] += len(text)
            stats["packages"][package] = dict(version=version, documents=len(docs))
    finally:
        for handle in handles.values():
            handle.close()
    for split, path in tmp.items():
        os.replace(path, folder / f"{split}.jsonl")
    with open(folder / "stats.json", "w", encoding="utf-8") as handle:
        json.dump(stats, handle, indent=1)
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", choices=[*CORPORA, "all"], default="all")
    p.add_argument("--output_dir", default="outputs/corpora")
    p.add_argument("--workdir", default=None, help="Where .debs are downloaded and unpacked (default: a temp dir).")
    args = p.parse_args(argv)
    names = list(CORPORA) if args.corpus == "all" else [args.corpus]
    with tempfile.TemporaryDirectory(prefix="brillm-corpora-") as default_work:
        workdir = Path(args.workdir or default_work)
        for name in names:
            s = build(name, Path(args.output_dir), workdir)
            print(f"{name}: {s['train_documents']:,} training documents ({s['train_chars'] / 1e6:.1f} M characters), "
                  f"{s['validation_documents']:,} held out ({s['validation_chars'] / 1e6:.2f} M); "
                  f"packages {', '.join(k + ' ' + v['version'] for k, v in s['packages'].items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
