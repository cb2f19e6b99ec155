"""Offline text corpora for the quality benchmarks: Debian packages turned into plain text.

    python benchmarks/corpora.py --output_dir outputs/corpora            # every corpus (needs apt-get, dpkg-deb)
    python benchmarks/corpora.py --corpus small --output_dir outputs/corpora

Package registries are the only sources reachable here: `apt-get download` fetches a `.deb` (Debian main:
redistributable licences), `dpkg-deb -x` unpacks it, corpus_text.py reads its files; nothing is installed or
committed. Every 20th document by a hash of its id (its path; `#chapter` or `#group` where a file holds many) is held
out, so train and validation never share a page, a chapter, a group of quotes or a module: <name>/train.jsonl and
validation.jsonl ({"text", "source"} a document) and <name>/stats.json (the packages, their versions, the sizes).
"""

import argparse
import contextlib
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_text import PACKAGE_SKIP, bible_chapters, fortune_groups, go_text, html_to_text, pod_to_text, python_text

DOC_PACKAGES = {  # package -> its files that are documents (globs in the unpacked tree)
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
RUST = "usr/share/doc/rust-doc/html/"
# the mdBook books (not the API reference: code comments); of The Rust Programming Language only the current
# edition's chapters (the older editions' pages are the same text again, or stubs pointing to it)
BOOK_PACKAGES = {"rust-doc": [RUST + "book/" + page for page in ("ch*.html", "appendix-*.html", "foreword.html")]
                 + [RUST + book + "/**/*.html" for book in ("reference", "nomicon", "rust-by-example", "edition-guide",
                                                             "embedded-book", "rustc")]}
FORTUNES = "usr/share/games/fortunes/"
LITERATURE_PACKAGES = {
    "bible-kjv-text": ["usr/lib/bible.data"],
    "fortunes-min": [FORTUNES + name for name in ("fortunes", "literature", "riddles")],
    # quotations of named people; not the jokes, ASCII art, song lyrics or Unix lore, nor fortunes-off
    "fortunes": [FORTUNES + name for name in ("people", "wisdom", "humorists", "love")],
}
SITE = "usr/lib/python3/dist-packages/"
# Debian splits CPython 3.11's standard library over these six packages (its tests, left out, over more)
STDLIB_PACKAGES = ["libpython3.11-minimal", "libpython3.11-stdlib", "python3-distutils", "python3-lib2to3",
                   "python3-tk", "idle-python3.11"]
CODE_PACKAGES = {**{package: ["usr/lib/python3.11/**/*.py"] for package in STDLIB_PACKAGES},
                 **{f"python3-{name}": [SITE + f"{name}/**/*.py"] for name in ("sympy", "numpy", "scipy", "pandas")},
                 "python3-matplotlib": [SITE + "matplotlib/**/*.py", SITE + "mpl_toolkits/**/*.py"],
                 **{f"python3-{name}": [SITE + f"{name}/**/*.py"] for name in ("django", "sklearn", "networkx")}}
PACKAGES = {**DOC_PACKAGES, **BOOK_PACKAGES, **LITERATURE_PACKAGES, **CODE_PACKAGES,
            "golang-1.19-src": ["usr/share/go-1.19/src/**/*.go"],
            "linux-doc-6.1": ["usr/share/doc/linux-doc-6.1/html/**/*.html"],
            "cmake-doc": ["usr/share/doc/cmake-data/html/**/*.html"],
            "debian-handbook": ["usr/share/doc/debian-handbook/html/de-DE/*.html"],
            "python3.11-doc": ["usr/share/doc/python3.11/html/**/*.html"]}
# matched files that are no document of their own: mdBook's page that repeats a whole book (it would put every
# held-out chapter in the training text), Go's tests, test data, vendored modules and the toolchain's commands, the
# kernel documentation's translations, and Sphinx's index and search pages and its copies of the sources
LEFT_OUT = re.compile(r"/print\.html$|_test\.go$|/testdata/|/vendor/|/go-1\.19/src/cmd/"
                      r"|/linux-doc-6\.1/html/(translations/|_sources/|_static/|genindex\.html$|search\.html$)"
                      r"|/(cmake-data|python3\.11)/html/(_sources/|_static/|genindex\.html$|search\.html$)")
CORPORA = {"small": ["git-doc"], "large": list(DOC_PACKAGES), "literature": list(LITERATURE_PACKAGES),
           "code": STDLIB_PACKAGES, "code-large": list(CODE_PACKAGES),
           "code-django": ["python3-django", "python3-networkx"], "code-plots": ["python3-matplotlib",
                                                                                "python3-networkx"],
           "rust-books": list(BOOK_PACKAGES), "code-go": ["golang-1.19-src"], "linux-docs": ["linux-doc-6.1"],
           "cmake-docs": ["cmake-doc"], "handbook-de": ["debian-handbook"]}
CORPORA["joined"] = [*dict.fromkeys(p for packages in CORPORA.values() for p in packages), "python3.11-doc"]
HOLD_OUT_EVERY = 20
MIN_DOCUMENT_CHARS = 200  # index pages, redirects and empty stubs carry no language


def held_out(document_id: str) -> bool:
    """Every HOLD_OUT_EVERY-th document, by a hash of its id (stable across rebuilds and orderings)."""
    return int(hashlib.sha1(document_id.encode()).hexdigest(), 16) % HOLD_OUT_EVERY == 0


def fetch_package(package: str, workdir: Path) -> tuple[Path, str]:
    """(unpacked tree, version) of a Debian package: `apt-get download`, then `dpkg-deb -x` (nothing installed)."""
    debs = workdir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if not sorted(debs.glob(f"{package}_*.deb")):
        result = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        if result.returncode != 0 or not sorted(debs.glob(f"{package}_*.deb")):
            raise SystemExit(f"error: apt-get download {package} failed ({result.stderr.strip().splitlines()[-1:]}); "
                             "run `apt-get update` first, or check that Debian's archive is reachable.")
    deb, tree = sorted(debs.glob(f"{package}_*.deb"))[-1], workdir / package
    if not tree.is_dir():
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    return tree, urllib.parse.unquote(deb.name.split("_")[1])


def file_documents(doc_id: str, path: Path, seen: set[str], skip: frozenset = frozenset()):
    """(document id, text) of the documents in one file, read by its kind."""
    if path.suffix in (".py", ".go"):
        yield doc_id, (python_text if path.suffix == ".py" else go_text)(path.read_bytes(), seen)
    elif path.name == "bible.data":
        yield from bible_chapters(doc_id, path.read_bytes())
    elif not path.suffix:  # a fortune file
        yield from fortune_groups(doc_id, path.read_bytes().decode("utf-8", errors="replace"))
    else:
        raw = path.read_bytes().decode("utf-8", errors="replace")
        yield doc_id, pod_to_text(raw) if path.suffix == ".pod" else html_to_text(raw, skip)


def documents(package: str, tree: Path):
    """(document id, text) of every document of an unpacked package, by path; a book's page given twice once
    (mdBook's index.html is the first chapter again)."""
    paths = sorted({p for pattern in PACKAGES[package] for p in tree.glob(pattern)
                    if p.is_file() and not LEFT_OUT.search(f"/{p.relative_to(tree).as_posix()}")})
    seen, pages = set(), set()  # the package's docstrings and comment blocks so far; a book's pages so far
    skip = PACKAGE_SKIP.get(package, frozenset())
    for path in paths:
        for doc_id, text in file_documents(f"{package}/{path.relative_to(tree)}", path, seen, skip):
            if len(text) < MIN_DOCUMENT_CHARS or text in pages:
                continue
            if package in BOOK_PACKAGES:
                pages.add(text)
            yield doc_id, text


@functools.lru_cache(maxsize=None)
def package_documents(package: str, workdir: Path) -> tuple[str, list[tuple[str, str]]]:
    """(version, documents) of a package, read once per run: corpora share packages."""
    tree, version = fetch_package(package, workdir)
    return version, list(documents(package, tree))


def build(name: str, output_dir: Path, workdir: Path) -> dict:
    folder = output_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    stats = dict(corpus=name, packages={}, hold_out=f"every {HOLD_OUT_EVERY}th document by sha1 of its id",
                 train_documents=0, validation_documents=0, train_chars=0, validation_chars=0)
    tmp = {split: folder / f".tmp-{split}.jsonl" for split in ("train", "validation")}
    with contextlib.ExitStack() as stack:
        files = {split: stack.enter_context(open(path, "w", encoding="utf-8")) for split, path in tmp.items()}
        for package in CORPORA[name]:
            version, docs = package_documents(package, workdir)
            for doc_id, text in docs:
                split = "validation" if held_out(doc_id) else "train"
                files[split].write(json.dumps({"text": text, "source": doc_id}, ensure_ascii=False) + "\n")
                stats[f"{split}_documents"] += 1
                stats[f"{split}_chars"] += len(text)
            stats["packages"][package] = dict(version=version, documents=len(docs))
    for split, path in tmp.items():
        os.replace(path, folder / f"{split}.jsonl")
    (folder / "stats.json").write_text(json.dumps(stats, indent=1), encoding="utf-8")
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", choices=[*CORPORA, "all"], default="all")
    p.add_argument("--output_dir", default="outputs/corpora")
    p.add_argument("--workdir", help="where the .debs are downloaded and unpacked (default: a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="brillm-corpora-") as default_work:
        for name in list(CORPORA) if args.corpus == "all" else [args.corpus]:
            s = build(name, Path(args.output_dir), Path(args.workdir or default_work))
            print(f"{name}: {s['train_documents']:,} training documents ({s['train_chars'] / 1e6:.1f} M characters), "
                  f"{s['validation_documents']:,} held out ({s['validation_chars'] / 1e6:.2f} M); "
                  f"packages {', '.join(k + ' ' + v['version'] for k, v in s['packages'].items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
