"""Benchmark records: a run writes one JSON record with its command, commit, machine, arguments and figures, and
docs/benchmarks.md's and docs/ablations.md's tables hold only numbers that the records they cite hold."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests._scripts import ROOT, load_script

RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
DOCS = (DOC, ROOT / "docs" / "ablations.md")  # the pages whose tables are read from records
CITED = re.compile(r"benchmarks/results/[\w.-]+\.json")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
# scripts under benchmarks/ that print no figures of a run: helpers, and the corpus builder (its stats.json)
NOT_BENCHMARKS = {"common.py", "reference_impl.py", "corpora.py"}


def test_a_run_writes_its_record(tmp_path):
    bench = load_script("benchmarks/long_context.py", "brillm_long_context_benchmark")
    argv = ["--tokens", "120", "--window", "20", "--ways", "loop", "--vocab", "40", "--successors", "4",
            "--results_dir", str(tmp_path)]
    results = bench.main(argv)
    files = list(tmp_path.iterdir())
    assert [f.name[:len("long_context-")] for f in files] == ["long_context-"], files  # no temporary file left
    record = json.loads(files[0].read_text())
    assert record["benchmark"] == "long_context"
    assert record["argv"] == ["benchmarks/long_context.py", *argv]
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and isinstance(record["dirty"], bool)
    machine = record["machine"]
    assert machine["cpu_count"] >= 1 and machine["cpu"] and machine["platform"]
    assert machine["torch"].startswith("2.") and machine["transformers"]
    assert "cuda_device" in machine
    assert record["arguments"]["tokens"] == 120 and record["arguments"]["ways"] == ["loop"]
    assert record["figures"]["results"][0]["tokens"] == 120 == results[0]["tokens"]
    assert record["figures"]["results"][0]["first_ms"] == pytest.approx(results[0]["first_ms"])


def test_records_are_strict_json_and_written_whole(tmp_path):
    common = load_script("benchmarks/common.py", "brillm_benchmark_common")
    first = common.write_record("unit", {"n": 1}, {"nan": float("nan"), "rows": (1, 2)}, results_dir=tmp_path)
    second = common.write_record("unit", {"n": 2}, {}, results_dir=tmp_path)
    assert first != second and first.exists() and second.exists()  # two runs in one second keep both
    assert json.loads(first.read_text(), parse_constant=pytest.fail)["figures"] == {"nan": None, "rows": [1, 2]}

    class Broken:
        def __str__(self):
            raise RuntimeError("cannot write this")

    with pytest.raises(RuntimeError):
        common.write_record("unit", {}, {"x": Broken()}, results_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


def test_every_benchmark_script_writes_a_record():
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name not in NOT_BENCHMARKS)
    assert len(scripts) >= 12
    for script in scripts:
        text = script.read_text()
        assert "add_results_dir(" in text and f'write_record("{script.stem}"' in text, script.name


def test_stored_records_have_their_fields():
    records = sorted(RESULTS.glob("*.json"))
    assert records
    for path in records:
        record = json.loads(path.read_text())
        assert path.name.startswith(record["benchmark"] + "-"), path.name
        for field in ("time_utc", "argv", "commit", "machine", "arguments", "figures"):
            assert field in record, (path.name, field)
        assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), path.name
        if "source" in record:  # transcribed, not a run's own output: it says from where
            assert re.fullmatch(r"transcribed from docs/[\w.]+\.md at [0-9a-f]{7,40}", record["source"]), path.name
            assert record["commit"].startswith(record["source"].rsplit(" ", 1)[1])


def numbers(text: str) -> set[float]:
    return {float(n.rstrip(",").replace(",", "")) for n in NUMBER.findall(text) if n.rstrip(",")}


def record_numbers(value) -> set[float]:
    if isinstance(value, dict):
        return set().union(*map(record_numbers, value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*map(record_numbers, value)) if value else set()
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, (int, float)):
        return {float(value)}
    return numbers(str(value))


def sections(markdown: str) -> list[tuple[str, str]]:
    """(heading, text) of every section of headings ## and ###."""
    parts = re.split(r"^(#{2,3} .*)$", markdown, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def tables(text: str) -> list[list[str]]:
    """The body rows of every Markdown table in `text` (the header and the |---| line left out)."""
    found, rows = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            rows = [] if rows is None else rows
            rows.append(line)
        elif rows is not None:
            found.append(rows[2:])
            rows = None
    if rows is not None:
        found.append(rows[2:])
    return found


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def shown_as(text: str, value: float) -> bool:
    """`value` (a record's) is the doc's `text` to the significant digits the doc shows (1.28e-7 for 1.2808e-07)."""
    mantissa = re.split(r"[eE]", text.rstrip(",").replace(",", "").lstrip("+-"))[0].replace(".", "").lstrip("0")
    digits = max(len(mantissa), 1)
    return same(float(text.rstrip(",").replace(",", "")), float(f"{value:.{digits}g}"))


def test_docs_tables_come_from_the_records_they_cite():
    checked = 0
    for heading, text in (part for doc in DOCS for part in sections(doc.read_text(encoding="utf-8"))):
        body = [row for table in tables(text) for row in table if numbers(row)]
        if not body:
            continue  # no table, or none with figures (the fields of a record)
        cited = sorted(set(CITED.findall(text)))
        assert cited, f"{heading}: a table with figures cites no record"
        held = set()
        for name in cited:
            path = ROOT / name
            assert path.is_file(), f"{heading}: cites {name}, which does not exist"
            held |= record_numbers(json.loads(path.read_text()))
        for row in body:
            for shown in (n for n in NUMBER.findall(row) if n.rstrip(",")):
                assert any(shown_as(shown, h) for h in held), f"{heading}: {shown} of row {row!r} is in none of {cited}"
                checked += 1
    assert checked > 300


def test_benchmarks_doc_is_a_reference_of_at_most_30_kb():
    for doc in DOCS:
        assert len(doc.read_bytes()) <= 30_000, doc.name
    text = DOC.read_text(encoding="utf-8")
    for name in set(re.findall(r"\(img/([\w.-]+)\)", text)):
        assert (DOC.parent / "img" / name).is_file(), name
