"""The explorer's two scripts as their users meet them: the command line's messages (modeling_brillm/explorer/cli.py,
behind examples/visualize.py: one line each, the fix the command line has, no library noise); the app's
(modeling_brillm/explorer/app.py, behind examples/app.py) list of models, its messages that say nothing of the
server's files, and its bounded cache; and both scripts without the package (one line, status 2). None of these
needs a browser or Gradio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import save_tiny

from modeling_brillm.explorer import app as explorer_app
from modeling_brillm.explorer import cli, explore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripts") / "tiny"
    save_tiny(path)
    return path


@pytest.fixture(scope="module")
def visualize():
    return cli.main


@pytest.fixture(scope="module")
def app():
    return explorer_app


def run(main, argv, capfd):
    """(exit code, stdout, the lines of stderr) of visualize.py's main, captured at the file descriptors, so a
    library's progress bar or warning would show up."""
    capfd.readouterr()
    code = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err.splitlines()


def embedded(path) -> dict:
    html = Path(path).read_text(encoding="utf-8")
    start = html.index('id="brillm-data">') + len('id="brillm-data">')
    return json.loads(html[start:html.index("</script>", start)])


def test_visualize_writes_the_page_without_library_noise(visualize, folder, tmp_path, capfd):
    page = tmp_path / "page.html"
    code, out, err = run(visualize, ["--model", folder, "--text", "the cat sat", "--html", page, "--generate", 5,
                                     "--node", "d", "--node", 7], capfd)
    assert code == 0 and err == []  # no "Loading weights" bar, no warning
    assert "wrote " + str(page) in out
    data = embedded(page)
    assert [p["kind"] for p in data["paths"]] == ["trace", "generation"] and len(data["paths"][1]["steps"]) == 5
    assert data["labels"][str(data["focus"])] == "d" and data["added"][1:] == [7]  # a token, and a node by its id
    assert "7" in data["nodes"]
    assert data["title"] == "BriLLM explorer: tiny"  # the folder's name, not its path
    compared = tmp_path / "diff.html"
    code, out, err = run(visualize, ["--model", folder, "--compare", folder, "--text", "the cat", "--html",
                                     compared], capfd)
    assert code == 0 and err == [] and embedded(compared)["diff"]["changed"] == []  # a model against itself


@pytest.mark.parametrize(("argv", "message"), [
    (["--text", ""], "error: the text is empty: give --text some words to trace"),
    (["--generate", "-3", "--html", "p.html"], "error: --generate takes a number of new tokens, 0 or more (got -3)"),
    (["--generate", "5"], "error: --generate adds to the interactive page: give --html PAGE.html too"),
    (["--node", " cat"], "error: --node adds to the interactive page: give --html PAGE.html too"),
    (["--compare", "other"], "error: --compare adds to the interactive page: give --html PAGE.html too"),
    (["--text", "the cat " * 10], "error: the text holds 81 tokens, more than the 64 positions this model was "
                                  "trained on: pass --extend to read past them."),
    (["--node", "1000", "--html", "p.html"], "error: node 1000 is outside the vocabulary [0, 25) of this model."),
    (["--model", "{tmp}/mistyped/model"], "error: no such folder: '{tmp}/mistyped/model'."),
    (["--model", "{tmp}"], "error: '{tmp}' is not a BriLLM model folder (it holds no config.json): give the folder "
                           "save_pretrained wrote."),
], ids=["empty-text", "negative-generate", "generate-without-html", "node-without-html", "compare-without-html",
        "past-the-positions", "node-id-outside", "missing-folder", "not-a-model"])
def test_visualize_refuses_with_one_line(visualize, folder, tmp_path, capfd, argv, message):
    given = {"--model": str(folder), "--text": "the cat", "--json": str(tmp_path / "t.json")}
    for flag, value in zip(argv[::2], argv[1::2]):
        given[flag] = value.format(tmp=tmp_path)
    code, out, err = run(visualize, [a for kv in given.items() for a in kv], capfd)
    assert code == 2 and err == [message.format(tmp=tmp_path)]
    assert not (tmp_path / "p.html").exists()


def test_visualize_extends_when_told(visualize, folder, tmp_path, capfd):
    code, out, err = run(visualize, ["--model", folder, "--text", "the cat " * 10, "--json", tmp_path / "t.json",
                                     "--extend"], capfd)
    assert code == 0 and err == [] and json.loads((tmp_path / "t.json").read_text())["summary"]["steps"] == 80


HIDDEN = """import runpy, sys
sys.modules["modeling_brillm"] = None  # as where the package is not installed: only the folder's code is there
sys.argv = [{script!r}, "--model", {folder!r}, "--text", "the cat", "--json", {out!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(script: str, folder, tmp_path, hidden: bool):
    """examples/<script> run as its user runs it, with the package installed or, `hidden`, as if it were not."""
    path, out = str(ROOT / "examples" / script), str(tmp_path / "t.json")
    command = (["-c", HIDDEN.format(script=path, folder=str(folder), out=out)] if hidden else
               [path, "--model", str(folder), "--text", "the cat", "--json", out])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=300)


def test_the_scripts_need_the_package_and_never_run_a_folders_code(folder, tmp_path):
    """visualize.py reads a folder with the installed package's BriLLM; without the package it says how to install
    it in one line and exits with status 2, and the folder's own code never runs (its configuration module, when
    imported, would leave a mark). app.py says the same."""
    copy = tmp_path / "downloaded"
    subprocess.run(["cp", "-r", str(folder), str(copy)], check=True)
    mark = tmp_path / "code-ran"
    code_file = copy / "configuration_brillm.py"
    code_file.write_text(code_file.read_text() + f"\nopen({str(mark)!r}, 'a').write('ran')\n")
    for script, install in (("visualize.py", "."), ("app.py", '".[app]"')):
        result = run_script(script, copy, tmp_path, hidden=True)
        assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
        assert result.stderr.splitlines() == [f"error: {script} needs BriLLM's package: pip install -e {install} in "
                                              "the repository"]
    result = run_script("visualize.py", copy, tmp_path, hidden=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    assert json.loads((tmp_path / "t.json").read_text())["summary"]["steps"] == 7 and not mark.exists()


def test_the_app_opens_only_the_models_it_was_started_with(app, folder, tmp_path):
    other = tmp_path / "other"
    save_tiny(other)
    models = app.Models([str(folder)])
    model, tokenizer, _ = models.get(str(folder))
    for name in (str(other), str(tmp_path / "missing"), "/etc", "gpt2"):
        with pytest.raises(ValueError) as error:
            models.get(name)
        assert str(error.value) == app.NOT_LISTED
    page, status = app.explore_prompt(models, str(other), "the cat", 3, False, 1.0, 0, False)
    assert status == "error: " + app.NOT_LISTED and "not a BriLLM" not in page


def test_with_any_model_allowed_its_errors_say_nothing_of_the_servers_files(app, tmp_path):
    """A missing path, an empty folder, a file, another model type's folder and a broken config all read the same,
    so the page cannot be used to learn which paths exist on the server."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    models = app.Models([], allow_any=True)
    names = [str(tmp_path / n) for n in ("missing", "empty", "file.txt", "gpt", "broken")] + ["/root", "/etc/passwd"]
    statuses = set()
    for name in names:
        with pytest.raises(ValueError) as error:
            models.get(name)
        assert str(error.value) == app.CANNOT_OPEN.format(name=name)
        _, status = app.explore_prompt(models, name, "the cat", 3, False, 1.0, 0, False)
        statuses.add(status.replace(repr(name), "NAME"))
    assert len(statuses) == 1 and models.loaded == {}


def test_the_apps_cache_holds_one_model_per_folder_and_a_few_folders(app, folder, tmp_path, monkeypatch):
    second, third = tmp_path / "second", tmp_path / "third"
    save_tiny(second)
    save_tiny(third)
    (tmp_path / "link").symlink_to(folder)
    models = app.Models([str(folder), str(second), str(third)], size=2)
    monkeypatch.chdir(folder.parent)
    spellings = [str(folder), str(folder) + "/", f"./{folder.name}", f"{folder.parent}/../{folder.parent.name}/"
                 f"{folder.name}", str(tmp_path / "link"), f" {folder} "]
    first = models.get(spellings[0])[0]
    assert all(models.get(s)[0] is first for s in spellings) and len(models.loaded) == 1
    models.get(str(second))
    models.get(str(folder))  # used again: the second is now the least recent
    models.get(str(third))
    assert list(models.loaded) == [os.path.realpath(folder), os.path.realpath(third)]


def test_the_apps_messages_fit_the_page(app, folder):
    models = app.Models([str(folder)])
    _, status = app.explore_prompt(models, str(folder), "", 3, False, 1.0, 0, False)
    assert status == "error: the prompt is empty: type a few words to trace and continue."
    _, status = app.explore_prompt(models, str(folder), "the cat " * 10, 3, False, 1.0, 0, False)
    assert status == ("error: the text holds 81 tokens, more than the 64 positions this model was trained on: tick "
                      "\u201cread past the trained positions\u201d to read past them.")
    _, status = app.explore_prompt(models, str(folder), "the cat " * 10, 3, False, 1.0, 0, True)
    assert status.startswith("80 steps traced") and status.endswith("3 tokens generated")
    model = models.get(str(folder))[0]
    assert model.config.position_overflow != "extend"  # the checkbox applies to its own request only
    assert app.check_listed([], False).startswith("give --model")
    assert app.check_listed([str(folder), str(folder.parent / "typo")], False) == (
        f"no such folder: {str(folder.parent / 'typo')!r}.")
    assert app.check_listed([str(folder / "config.json")], False).endswith("is a file, not a model folder: give the "
                                                                          "folder save_pretrained wrote.")
    assert app.check_listed([], True) is None and app.check_listed([str(folder)], False) is None


def test_the_page_of_the_app_is_the_explorers(app, folder):
    models = app.Models([str(folder)])
    frame, status = app.explore_prompt(models, str(folder), "the cat sat", 4, False, 1.0, 0, False)
    model, tokenizer, _ = models.get(str(folder))
    expected = explore(model, "the cat sat", tokenizer, prompt="the cat sat", max_new_tokens=4)
    assert status.startswith(f"{len(expected.data['paths'][0]['steps'])} steps traced")
    assert frame == expected.iframe(app.HEIGHT)
