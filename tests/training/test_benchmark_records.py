"""Benchmark records: a run writes one JSON record with its command, commit, machine, arguments and figures, and
every figure of docs/benchmarks.md's and docs/ablations.md's tables is the record field its table names for it."""

from __future__ import annotations

import json
import re

import pytest

from tests._scripts import ROOT, load_script

RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
DOCS = (DOC, ROOT / "docs" / "ablations.md")  # the pages whose tables are read from records
# scripts under benchmarks/ that print no figures of a run: helpers, and the corpus builder (its stats.json)
NOT_BENCHMARKS = {"common.py", "corpora.py", "corpus_text.py", "gpt2.py"}


def test_a_run_writes_its_record(tmp_path):
    bench = load_script("benchmarks/decode_throughput.py", "brillm_decode_throughput_benchmark")
    argv = ["--long", "120", "--window", "20", "--ways", "loop", "--vocab", "40", "--successors", "4",
            "--results_dir", str(tmp_path)]
    figures = bench.main(argv)
    files = list(tmp_path.iterdir())
    assert [f.name[:len("decode_throughput-")] for f in files] == ["decode_throughput-"], files  # no temporary file
    record = json.loads(files[0].read_text())
    assert record["benchmark"] == "decode_throughput"
    assert record["argv"] == ["benchmarks/decode_throughput.py", *argv]
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and isinstance(record["dirty"], bool)
    machine = record["machine"]
    assert machine["cpu_count"] >= 1 and machine["cpu"] and machine["platform"]
    assert machine["torch"].startswith("2.") and machine["transformers"]
    assert "cuda_device" in machine
    assert record["arguments"]["long"] == 120 and record["arguments"]["ways"] == ["loop"]
    assert record["figures"]["results"][0]["tokens"] == 120 == figures["results"][0]["tokens"]
    assert record["figures"]["results"][0]["first_ms"] == pytest.approx(figures["results"][0]["first_ms"])


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
    assert len(scripts) >= 8
    for script in scripts:  # --results_dir: common.add_results_dir (recipe_sweep.py: through quality.py's flags)
        text = script.read_text()
        assert ("add_results_dir(" in text or "quality.shared_arguments(" in text), script.name
        assert f'write_record("{script.stem}"' in text, script.name


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


# ------------------------------------------------------------------------------------ the docs' figures
# Every table of docs/benchmarks.md and docs/ablations.md with a figure is followed by a `<!-- fields ... -->` block
# that ties each of its cells to the record fields the cell shows:
#
#     <!-- fields
#     A = train_throughput-20261123T203928Z           a record of benchmarks/results (the first: the default)
#     row *: rows/{i}                                 body row i (from 0) reads the default record's rows/i
#     row 5: A:rows/4                                 or one row's own base path
#     tokens/s: tokens_per_s                          a column: the fields its cells show, after the row's base
#     of floor: of_floor*100 + B:x/y + ~z             several fields in order; *100 scales; B: another record;
#                                                     ~: the field's size (the cell shows no sign)
#     cell 3 / tokens/s: B:rows/0/tokens_per_s        one cell (row number from 1 or its first cell's text)
#     in #4 #6: small = B:; code = C:models/0         these cells' bases (a record, a path in it)
#     fields base: curve/-1/perplexity                every cell of a row: these fields (after the cell's base)
#     $ppl = curve/-1/perplexity + vs_base_percent    a name for fields, used in the lines after it
#     -->
#
# A path's segments are keys, list indices (-1: the last) or `[key=value]` (the one element of a list whose `key`
# is `value`); `*` or `[key!=a,b]` take every element (but those whose key is a or b); `range:` before a path gives
# the least and the largest of its numbers (a cell "1-5"). A path starts at the record's figures (`^`: the record).
# Columns are named by their heading or as #N; `#N` and `fields ROW` lines may name columns the same way. A cell's
# numbers, in order and with their signs, must be its fields' numbers (a text field gives the numbers written in
# it) to the digits the cell shows: a wrong digit fails. A cell with no number claims nothing. The records a
# table's fields read are cited under it, and its "Record(s):" line cites no other. A figure marked \u2020 is one no
# record holds; the text under its table says where it comes from. A table that reads a transcribed record says
# "(transcribed)" in its first heading.
SIGNED = re.compile(r"(?<![\w.])[-+\u2212]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|(?<=[\w.])\d[\d,]*(?:\.\d+)?")
CELL_MARKUP = re.compile(r"\*\*|`")
UNTIED = re.compile(r"[-+\u2212]?\d[\d,.]*\u2020")  # a figure marked † is in no record (the table says so)


def figures_in(text: str) -> list[str]:
    """The numbers written in `text`, signs kept (a hyphen between two numbers is a range, not a sign)."""
    found = []
    for raw in SIGNED.findall(text):
        raw = raw.rstrip(",")
        if raw and any(c.isdigit() for c in raw):
            found.append(raw)
    return found


def as_float(text: str) -> float:
    return float(text.replace(",", "").replace("\u2212", "-"))


def shows(text: str, value: float) -> bool:
    """`text` (a doc's number) is `value` rounded to the digits `text` shows (either way at an exact half)."""
    mantissa, _, exponent = text.replace(",", "").replace("\u2212", "-").partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    unit = 10.0 ** (-decimals + (int(exponent) if exponent else 0))
    return abs(as_float(text) - value) <= unit / 2 * (1 + 1e-9) + 1e-12 * abs(value)


def record_figures(value) -> list:
    """The numbers a record field gives, in order: a number, the numbers written in a text, those of a list."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, list):
        return [n for v in value for n in record_figures(v)]
    if isinstance(value, dict):
        raise AssertionError(f"a field names a whole object, not a figure: {sorted(value)[:6]}")
    return [as_float(n) for n in figures_in(str(value))]


def walk(record: dict, path: str):
    node = record if path.startswith("^") else record["figures"]
    segments = [segment for segment in path.lstrip("^").split("/") if segment]
    for n, segment in enumerate(segments):
        if segment == "*" or segment.startswith("[") and "!=" in segment:  # every element (but those named)
            key, _, unwanted = segment[1:-1].partition("!=")
            rest = "/".join(segments[n + 1:])
            return [walk({"figures": item}, rest) for item in node
                    if segment == "*" or str(item.get(key)) not in unwanted.split(",")]
        if segment.startswith("[") and segment.endswith("]"):
            key, _, wanted = segment[1:-1].partition("=")
            hits = [item for item in node if isinstance(item, dict) and str(item.get(key)) == wanted]
            assert len(hits) == 1, f"{path}: {len(hits)} elements have {key} = {wanted!r}"
            node = hits[0]
        elif isinstance(node, list):
            node = node[int(segment)]
        else:
            assert segment in node, f"{path}: no field {segment!r} (there: {sorted(node)[:12]})"
            node = node[segment]
    return node


def table_blocks(markdown: str):
    """(table lines, the text after the table up to the next table or heading) of every table."""
    lines, i = markdown.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        end = i
        while end < len(lines) and not (lines[end].startswith("|") or re.match(r"#{1,6} ", lines[end])):
            end += 1
        yield lines[start:i], "\n".join(lines[i:end])


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


class FieldMap:
    """A table's `<!-- fields -->` block, parsed."""

    def __init__(self, text: str, header: list[str], body: list[list[str]]):
        self.records, self.rows, self.columns, self.cells, self.within, self.row_fields = {}, {}, {}, {}, {}, {}
        self.macros = {}
        self.header, self.body = [name.replace(" (transcribed)", "") for name in header], body
        for line in filter(None, (line.strip() for line in text.splitlines())):
            self.read(line)

    def read(self, line: str):
        name, sep, value = line.partition(" = ")
        if sep and re.fullmatch(r"[A-Z]\w*", name):
            self.records[name] = value.strip()
            return
        if sep and re.fullmatch(r"\$\w+", name):
            self.macros[name] = value.strip()
            return
        key, sep, value = line.partition(": ")
        assert sep, f"not `name: fields`: {line!r}"
        if key.startswith("row "):
            row = key[4:].strip()
            self.rows[row if row == "*" else str(self.row_index(row) + 1)] = value.strip()
        elif key.startswith("in "):  # in #3 #6: ROW = A:path; ROW = B:path: these cells' bases
            for pair in value.split(";"):
                row, _, spec = pair.strip().partition(" = ")
                for column in key[3:].split():
                    self.within[(self.row_index(row), self.column_index(column))] = self.split(spec, None)
        elif key.startswith("fields "):  # fields ROW: the fields of every cell of that row
            self.row_fields[self.row_index(key[7:].strip())] = value.strip()
        elif key.startswith("cell "):
            row, _, column = key[5:].partition(" / ")
            self.cells[(self.row_index(row.strip()), self.column_index(column.strip()))] = value.strip()
        else:
            self.columns[self.column_index(key)] = value.strip()

    def column_index(self, key: str) -> int:
        if re.fullmatch(r"#\d+", key):
            return int(key[1:]) - 1
        assert self.header.count(key) == 1, f"`{key}` is not one column of the table {self.header} (#N names one)"
        return self.header.index(key)

    def row_index(self, key: str) -> int:
        if key.isdigit():
            return int(key) - 1
        hits = [i for i, row in enumerate(self.body) if CELL_MARKUP.sub("", row[0]) == key]
        assert len(hits) == 1, f"{len(hits)} rows are named {key!r}"
        return hits[0]

    def record(self, alias: str) -> str:
        if alias not in self.records:
            raise AssertionError(f"record alias {alias!r} is not defined")
        return self.records[alias]

    def split(self, field: str, default: str | None):
        alias, sep, path = field.partition(":")
        if sep and re.fullmatch(r"[A-Z]\w*", alias):
            return self.record(alias), path
        return default, field

    def base(self, row: int):
        """(record, base path) of body row `row`."""
        spec = self.rows.get(str(row + 1), self.rows.get("*"))
        default = next(iter(self.records.values()), None)
        if spec is None:
            return default, ""
        return self.split(spec.replace("{i}", str(row)), default)

    def fields(self, row: int, column: int) -> list[tuple[str, str, float, bool]]:
        """(record, path, scale, magnitude only) of each field cell (row, column) shows; none where nothing maps
        it."""
        spec = self.cells.get((row, column)) or self.row_fields.get(row) or self.columns.get(column)
        if spec is None:
            return []
        record, base = self.within.get((row, column)) or self.base(row)
        for name, fields in self.macros.items():
            spec = spec.replace(name, fields)
        out = []
        for field in spec.split(" + "):
            field, _, scale = field.strip().partition("*")
            magnitude = field.startswith("~")  # the doc shows the size, not the sign
            span, field = field.lstrip("~").startswith("range:"), field.lstrip("~").removeprefix("range:")
            name, path = self.split(field, record)
            if name is record and not path.startswith(("^", "/")):  # in the cell's record: after its base
                path = f"{base}/{path}"
            out.append((name, "range:" * span + path, float(scale or 1), magnitude))
        assert all(field[0] for field in out), f"{self.header[column]}: no record named"
        return out

    def used(self) -> set[str]:
        return set(self.records.values())


def cell_values(fields: FieldMap, row: int, column: int, load) -> list[float]:
    """The numbers the fields of a cell hold, in order."""
    values = []
    for name, path, scale, magnitude in fields.fields(row, column):
        found = record_figures(walk(load(name), path.removeprefix("range:")))
        found = [min(found), max(found)] if path.startswith("range:") else found
        values += [abs(v) * scale if magnitude else v * scale for v in found]
    return values


def check_table(table: list[str], after: str, where: str, load) -> int:
    header = [CELL_MARKUP.sub("", cell) for cell in split_row(table[0])]
    body = [split_row(line) for line in table[2:]]
    if not any(figures_in(CELL_MARKUP.sub("", cell)) for row in body for cell in row):
        return 0
    block = re.search(r"<!-- fields(.*?)-->", after, re.S)
    assert block, f"{where}: a table of figures without a `<!-- fields -->` block after it"
    fields = FieldMap(block.group(1), header, body)
    cited = set(re.findall(r"benchmarks/results/([\w.-]+)\.json", after))
    assert fields.used() <= cited, f"{where}: its fields read {sorted(fields.used() - cited)}, not cited under it"
    claimed = {name for line in after.split("\n\n") if line.lstrip().startswith("Record")
               for name in re.findall(r"benchmarks/results/([\w.-]+)\.json", line)}
    assert claimed <= fields.used(), f"{where}: its records line cites {sorted(claimed - fields.used())}, " \
                                     "which no cell reads"
    transcribed = sorted(name for name in fields.used() if "source" in load(name))
    assert bool(transcribed) == ("transcribed" in header[0]), (
        f"{where}: reads the transcribed records {transcribed}: its first heading says (transcribed), and only then")
    if any(UNTIED.search(cell) for row in body for cell in row):
        assert "\u2020" in after, f"{where}: a figure is marked \u2020 (in no record) and no note under it says why"
    checked = 0
    for r, row in enumerate(body):
        for c, cell in enumerate(row):
            shown = figures_in(UNTIED.sub("", CELL_MARKUP.sub("", cell)))
            if not shown:
                continue  # no figure: nothing to tie (an empty cell, "=", "(lower)")
            values = cell_values(fields, r, c, load)
            assert len(shown) == len(values) and all(map(shows, shown, values)), (
                f"{where}: row {r + 1} ({row[0]}), column {header[c]!r}: the cell {cell!r} shows {shown}, its "
                f"fields {fields.fields(r, c)} hold {values}")
            checked += len(shown)
    return checked


def test_every_docs_figure_is_the_record_field_it_names():
    cache = {}

    def load(name):
        if name not in cache:
            path = RESULTS / f"{name}.json"
            assert path.is_file(), f"no record {name}"
            cache[name] = json.loads(path.read_text())
        return cache[name]

    checked = 0
    for doc in DOCS:
        for n, (table, after) in enumerate(table_blocks(doc.read_text(encoding="utf-8"))):
            checked += check_table(table, after, f"{doc.name}, table {n + 1} ({table[0][:60]})", load)
    assert checked > 600


@pytest.mark.parametrize("shown, value, ok", [
    ("9,099", 9099.4, True), ("9,099", 9098.4, False), ("10.690", 10.6904, True), ("10.690", 10.6914, False),
    ("8.6", 8.64, True), ("8.6", 8.66, False), ("6.4e-8", 6.43e-8, True), ("6.4e-8", 6.5e-8, False),
    ("\u22124.3", -4.3, True), ("\u22124.3", 4.3, False), ("+13.3", 13.3, True)])
def test_a_wrong_digit_or_sign_fails(shown, value, ok):
    assert shows(shown, value) is ok


def test_numbers_keep_their_signs_and_ranges():
    assert figures_in("**12.110 (+13.3%, 8.6\u00d7)**") == ["12.110", "+13.3", "8.6"]
    assert figures_in("0.85-0.95 \u2192 \u22121.5%, 1,929 GB") == ["0.85", "0.95", "\u22121.5", "1,929"]
    assert figures_in("0.85-0.95") == ["0.85", "0.95"]
    assert figures_in("GPT-2 4/128") == ["2", "4", "128"]


def test_benchmarks_doc_is_a_reference_of_at_most_30_kb():
    for doc in DOCS:  # what a reader reads: the `<!-- fields -->` blocks are for this test
        shown = re.sub(r"<!-- fields.*?-->\n?", "", doc.read_text(encoding="utf-8"), flags=re.S)
        assert len(shown.encode()) <= 30_000, doc.name
    text = DOC.read_text(encoding="utf-8")
    for name in set(re.findall(r"\(img/([\w.-]+)\)", text)):
        assert (DOC.parent / "img" / name).is_file(), name


@pytest.mark.parametrize("doc, figure, wrong", [(DOC, "| 9,099 |", "| 9,098 |"), (DOC, "| **32.6** |", "| **32.7** |"),
                                                (DOCS[1], "**12.110 (+13.3%, 8.6×)**", "**12.110 (+13.3%, 8.7×)**"),
                                                (DOCS[1], "| 2: -1.6% |", "| 2: +1.6% |")])
def test_a_wrong_digit_in_a_table_fails(doc, figure, wrong):
    text = doc.read_text(encoding="utf-8")
    assert figure in text

    def load(name):
        return json.loads((RESULTS / f"{name}.json").read_text())

    with pytest.raises(AssertionError, match="shows"):
        for table, after in table_blocks(text.replace(figure, wrong, 1)):
            check_table(table, after, doc.name, load)
