"""The benchmark scripts as modules, and a training command line's flag checks run in the test's own process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str):
    """The script at ROOT/relative, imported as module `name` (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _past_the_checks(args):
    raise AssertionError("the command line passed the flag checks: this error needs a subprocess run")


def refused(script, argv, monkeypatch, capsys) -> str:
    """The `error: ...` line `script.main(argv)` prints for a command line its flag checks refuse (`script`: a module
    whose `main` is modeling_brillm.training.pretraining's). Those checks run before any data, accelerator or process
    group, so this runs in the test's process and spares starting Python, torch and transformers again; the
    subprocess tests cover the same printing through a real launch."""
    monkeypatch.setattr(sys.modules[script.main.__module__], "start_run", _past_the_checks)
    try:
        code = script.main([str(a) for a in argv])
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert lines, err[-3000:]
    return lines[-1]
