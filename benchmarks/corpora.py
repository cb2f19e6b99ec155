"""Offline text corpora for the quality benchmarks: Debian's documentation packages turned into plain text.

    python benchmarks/corpora.py --output_dir outputs/corpora            # both corpora (needs apt-get, dpkg-deb)
    python benchmarks/corpora.py --corpus small --output_dir outputs/corpora

Why these: the embedded pydoc corpus is too small to rank recipes (every model overfits it within a minute), and
the only reachable sources here are package registries. Debian ships many manuals as HTML or POD in `doc` packages
(GPL / BSD / PostgreSQL / Artistic licences, all redistributable); `apt-get download` fetches the `.deb` without
installing it and `dpkg-deb -x` unpacks it. Nothing is committed: this script rebuilds the same files.

Corpora (documents = one HTML page or one POD file; every 20th document by a hash of its path is held out, so
train and validation never share a page):

    small   git's manual pages and user manual (git-doc): ~3 MB of training text
    large   small + PostgreSQL 15 manual, Perl's pod documentation, SQLite's documentation, the Debian reference,
            policy and developers' reference, bash and gnuplot manuals: >= 20 MB of training text

Each corpus is written as `<name>/train.jsonl` and `<name>/validation.jsonl`, one `{"text": ..., "source": ...}`
record per document; paragraphs are separated by a blank line and code blocks (HTML `pre`, POD verbatim
paragraphs) are indented, so the pretraining code's sentence splitter (`training.data.split_sentences`) reads
prose as sentences and code one line at a time. `<name>/stats.json` records the packages (name and version), the
document counts and the sizes. Use with `--train_file <dir>/train.jsonl --validation_file <dir>/validation.jsonl`.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

# package -> which of its files are documents (glob under the unpacked tree)
PACKAGES = {
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
CORPORA = {
    "small": ["git-doc"],
    "large": list(PACKAGES),
}
HOLD_OUT_EVERY = 20
MIN_DOCUMENT_CHARS = 200  # index pages, redirects and empty stubs carry no language

BLOCK_TAGS = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "table",
              "ul", "ol", "dl", "blockquote", "br", "hr", "caption", "figure", "td", "th", "title"}
SKIP_TAGS = {"script", "style", "head", "nav", "noscript", "svg"}
SKIP_CLASSES = {"navheader", "navfooter", "toc", "menu", "nav", "navigation", "footer", "header", "sidebar",
                "breadcrumbs", "mainmenu"}
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class _HTMLText(HTMLParser):
    """Text of an HTML page: paragraphs at block elements, `pre` blocks kept line by line (indented), scripts,
    styles and navigation (by tag or class) dropped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
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
        classes = set((dict(attrs).get("class") or "").split())
        if tag in SKIP_TAGS or classes & SKIP_CLASSES:
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


def html_to_text(source: str) -> str:
    parser = _HTMLText()
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


def documents(package: str, tree: Path):
    """(document id, text) of every document of an unpacked package, sorted by path."""
    paths = sorted({p for pattern in PACKAGES[package] for p in tree.glob(pattern) if p.is_file()})
    for path in paths:
        raw = path.read_bytes().decode("utf-8", errors="replace")
        text = pod_to_text(raw) if path.suffix == ".pod" else html_to_text(raw)
        if len(text) >= MIN_DOCUMENT_CHARS:
            yield f"{package}/{path.relative_to(tree)}", text


def build(name: str, output_dir: Path, workdir: Path) -> dict:
    folder = output_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    stats = dict(corpus=name, packages={}, hold_out=f"every {HOLD_OUT_EVERY}th document by sha1 of its path",
                 train_documents=0, validation_documents=0, train_chars=0, validation_chars=0)
    tmp = {split: folder / f".tmp-{split}.jsonl" for split in ("train", "validation")}
    handles = {split: open(path, "w", encoding="utf-8") for split, path in tmp.items()}
    try:
        for package in CORPORA[name]:
            tree, version = fetch_package(package, workdir)
            count = 0
            for doc_id, text in documents(package, tree):
                split = "validation" if held_out(doc_id) else "train"
                handles[split].write(json.dumps({"text": text, "source": doc_id}, ensure_ascii=False) + "\n")
                stats[f"{split}_documents"] += 1
                stats[f"{split}_chars"] += len(text)
                count += 1
            stats["packages"][package] = dict(version=version, documents=count)
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
