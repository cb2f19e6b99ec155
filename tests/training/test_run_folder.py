"""Never losing a user's run: the output folder's lock (two runs at once, a lock a dead run left), an earlier run
refused unless --overwrite_output_dir and then replaced only once the new model is saved (a failed or killed rerun
leaves the old model as it was), inputs checked before anything is touched, the train log read past a torn line and
written whole, a full disk named in one line, the Hub token kept out of everything a run writes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from modeling_brillm.training import checkpoints
from modeling_brillm.training import pretraining as pretrain
from modeling_brillm.training.checkpoints import LOCK_NAME, RunFolder
from modeling_brillm.training.errors import UsageError
from tests.training.test_pretrain import SCRIPT, TINY, WORDS, corpus, env, error_of, losses, run  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_NotARealTokenButSecret1234"
FINISHED = [*TINY, "--per_device_train_batch_size", "32", "--max_train_steps", "8", "--checkpointing_steps", "4"]
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "recipe.json")


def one_error(err: str) -> str:
    """The one `error:` line of a refused run's stderr (progress bars aside), no traceback."""
    lines = [line.split("\r")[-1] for line in err.splitlines() if "error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def digests(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):  # noqa: F811
    """A finished run (checkpoints step_4 and step_8, its log and model), given the Hub token on its command line."""
    out = tmp_path_factory.mktemp("finished") / "run"
    result = run(["--train_file", corpus, "--output_dir", out, *FINISHED, "--hub_token", TOKEN])
    return out, result


@pytest.fixture
def earlier(finished, tmp_path) -> Path:
    """A copy of the finished run, for a test to run into."""
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def in_process(monkeypatch, capsys):
    """pretrain.py's main in this process: (exit code, stdout, stderr)."""
    for key in ("TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(key, "false" if key.startswith("TOK") else "1")

    def main(*argv):
        code = pretrain.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return main


def other_corpus(folder: Path) -> Path:
    path = folder / "other.txt"
    lines = (f"{w} and {v} went to the {u}." for w in WORDS[:12] for v in WORDS[:6] for u in WORDS[-3:])
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ the lock
def test_a_second_run_into_a_held_folder_stops_at_once(earlier, corpus, in_process):  # noqa: F811
    before = digests(earlier)
    with RunFolder(earlier) as holder:
        holder.lock()
        code, _, err = in_process("--train_file", corpus, "--output_dir", earlier, *FINISHED,
                                  "--resume_from_checkpoint", "latest")
    assert code == 2
    assert f"is in use by another run (PID {os.getpid()} on {socket.gethostname()})" in err
    assert digests(earlier) == before and not (earlier / LOCK_NAME).exists()  # released by its holder only


def test_two_processes_cannot_hold_one_folder(tmp_path):
    """Another process's lock, live: refused; once it is dead, taken over with a message naming it."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, socket, sys, time; "  # RunFolder.lock's file
                               f"f = open({str(tmp_path / LOCK_NAME)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
                               "f.write(f'PID {os.getpid()} on {socket.gethostname()}\\n'); f.flush(); print('held', "
                               "flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=f"in use by another run \\(PID {holder.pid} on "):
            RunFolder(tmp_path).lock()
    finally:
        holder.kill()
        holder.wait()
    said = []
    folder = RunFolder(tmp_path)
    folder.lock(said.append)  # the dead holder's file is still there
    assert said == [f"taking over the lock of a run that ended without releasing it (PID {holder.pid} on "
                    f"{socket.gethostname()})"]
    assert (tmp_path / LOCK_NAME).read_text() == f"PID {os.getpid()} on {socket.gethostname()}\n"
    folder.release()
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------ an earlier run
def test_an_earlier_run_is_refused_without_overwrite(earlier, corpus, in_process):  # noqa: F811
    before = digests(earlier)
    code, _, err = in_process("--train_file", corpus, "--output_dir", earlier, *FINISHED)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert ("holds an earlier run (2 checkpoint(s), a train log, a saved model): continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir") in err
    assert digests(earlier) == before


@pytest.mark.parametrize("case", ["batch", "blank", "vocabulary"])
def test_a_failed_rerun_changes_nothing(case, earlier, corpus, tmp_path, in_process):  # noqa: F811
    """The inputs, tokenizer, graph and batch are checked before the folder is touched: the earlier run's model,
    checkpoints and log stay as they were."""
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    flags = {"batch": ["--train_file", other_corpus(tmp_path), "--vocab_size", "512",
                       "--per_device_train_batch_size", "100000"],
             "blank": ["--train_file", blank], "vocabulary": ["--train_file", corpus, "--vocab_size", "10"]}[case]
    before = digests(earlier)
    code, _, err = in_process(*FINISHED, *flags, "--output_dir", earlier, "--overwrite_output_dir")
    expected = {"batch": "cannot fill one global batch", "blank": "contains no text",
                "vocabulary": "could not train the tokenizer"}[case]
    assert code == 2 and expected in one_error(err)
    assert digests(earlier) == before


@pytest.mark.slow
def test_a_rerun_replaces_the_earlier_run_once_its_model_is_saved(earlier, tmp_path, in_process):
    code, out, _ = in_process(*FINISHED, "--train_file", other_corpus(tmp_path), "--vocab_size", "280",
                              "--output_dir", earlier, "--overwrite_output_dir")
    assert code == 0
    assert f"removing 2 checkpoint(s) of the earlier run in {earlier} (--overwrite_output_dir" in out
    from transformers import AutoTokenizer

    from modeling_brillm import BriLLMForCausalLM

    model, tokenizer = BriLLMForCausalLM.from_pretrained(earlier), AutoTokenizer.from_pretrained(earlier)
    assert model.config.vocab_size == len(tokenizer) and "other.txt" in (earlier / "README.md").read_text()
    state = checkpoints.read_train_state(earlier / "step_8")
    assert state["signature"]["vocab_size"] == len(tokenizer)
    assert not list(earlier.glob(".tmp-*")) and not (earlier / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_killed_rerun_leaves_the_old_model_loadable(earlier, tmp_path):
    """SIGKILL while an --overwrite_output_dir rerun trains on another text with another vocabulary: the folder
    still holds the old model, whole; the next run takes over the dead run's lock and resumes its checkpoint."""
    old = {name: digest for name, digest in digests(earlier).items() if name in MODEL_FILES}
    args = [sys.executable, str(SCRIPT), *FINISHED, "--train_file", str(other_corpus(tmp_path)), "--vocab_size",
            "280", "--output_dir", str(earlier), "--overwrite_output_dir", "--step_sleep", "1"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None and (earlier / "step_8").exists():
            time.sleep(0.05)  # the old run's checkpoints go once the rerun's inputs are checked
        while time.time() < deadline and proc.poll() is None and max(losses(earlier), default=0) < 5:
            time.sleep(0.05)
        assert proc.poll() is None, "the rerun ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {name: d for name, d in digests(earlier).items() if name in MODEL_FILES} == old
    from transformers import AutoTokenizer

    from modeling_brillm import BriLLMForCausalLM

    assert BriLLMForCausalLM.from_pretrained(earlier).config.vocab_size == len(AutoTokenizer.from_pretrained(earlier))
    result = run(args[2:-2] + ["--resume_from_checkpoint", "latest"])
    assert "taking over the lock of a run that ended without releasing it" in result.stdout
    assert "resumed from" in result.stdout and sorted(losses(earlier)) == list(range(1, 9))


def test_an_interrupted_swap_leaves_a_folder_that_does_not_load(tmp_path, monkeypatch):
    """The old config leaves first and the new one comes last: midway the folder refuses to load."""
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        for file in MODEL_FILES:
            (tmp_path / name / file).write_text(f"{name} {file}")
    folder = RunFolder(tmp_path / "old")
    shutil.copytree(tmp_path / "new", folder.staged)
    replace, moved = os.replace, []

    def interrupted(src, dst):
        if len(moved) == 2:
            raise KeyboardInterrupt
        moved.append(Path(dst).name)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        folder.install()
    assert "config.json" not in moved and not (tmp_path / "old" / "config.json").exists()
    monkeypatch.setattr(os, "replace", replace)
    shutil.copytree(tmp_path / "new", folder.staged, dirs_exist_ok=True)
    folder.install()
    assert {p.name: p.read_text() for p in (tmp_path / "old").iterdir()} == {f: f"new {f}" for f in MODEL_FILES}


# ------------------------------------------------------------------------------------------------- the log
def test_a_torn_last_line_is_read_past_and_a_line_is_written_whole(tmp_path, capsys, monkeypatch):
    log = tmp_path / checkpoints.LOG_NAME
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert checkpoints.read_log(log) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert "the last line of" in capsys.readouterr().err
    log.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(UsageError, match="line 2: not a JSON record"):
        checkpoints.read_log(log)
    log.write_text('{"step": 1}\n')
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:5]))  # the disk fills mid-line
    train_log = checkpoints.TrainLog(tmp_path, SimpleNamespace(is_main_process=True))
    with pytest.raises(UsageError, match=f"no space left in {tmp_path} for the train log"):
        train_log({"step": 2, "loss": 1.0})
    assert log.read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_a_resume_reads_past_a_torn_log_and_skips_a_corrupt_checkpoint(earlier, corpus, in_process):  # noqa: F811
    with open(earlier / checkpoints.LOG_NAME, "a") as handle:
        handle.write('{"step": 9, "lo')
    (earlier / "step_8" / checkpoints.STATE_NAME).write_text('{"completed_steps": 8, "ep')
    code, _, err = in_process("--train_file", corpus, "--output_dir", earlier, *FINISHED, "--resume_from_checkpoint",
                              earlier / "step_8")
    assert code == 2 and f"{earlier / 'step_8' / checkpoints.STATE_NAME} is corrupt (JSONDecodeError" in err
    code, out, err = in_process("--train_file", corpus, "--output_dir", earlier, *FINISHED,
                                "--resume_from_checkpoint", "latest")
    assert code == 0 and "warning: skipping step_8:" in out and f"resumed from {earlier / 'step_4'}" in out
    assert "is torn" in err and sorted(losses(earlier)) == list(range(1, 9))


# ---------------------------------------------------------------------------------------------- full disk
def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint(tmp_path):
    (tmp_path / "step_4").mkdir()
    (tmp_path / "step_4" / checkpoints.STATE_NAME).write_text('{"completed_steps": 4}')

    def full(folder, **_):
        Path(folder).mkdir()
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, save_state=full)
    with pytest.raises(UsageError, match=rf"no space left in {tmp_path} for checkpoint step_8 \(about 1\.0 MB; .* "
                                         "free\\): the checkpoints before it are intact; free space and continue"):
        checkpoints.save_checkpoint(accelerator, tmp_path, 8, {}, None, limit=1, need=2 ** 20)
    assert [p.name for p in tmp_path.iterdir()] == ["step_4"] and checkpoints.list_checkpoints(tmp_path)


@pytest.mark.slow
def test_a_full_disk_at_the_final_save_keeps_the_old_model(earlier, corpus, in_process, monkeypatch):  # noqa: F811
    from transformers import PreTrainedModel

    def full(self, folder, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    old = {name: digest for name, digest in digests(earlier).items() if name in MODEL_FILES}
    code, _, err = in_process("--train_file", corpus, "--output_dir", earlier, *FINISHED, "--overwrite_output_dir")
    assert code == 2 and f"no space left in {earlier} for the final model (about " in err
    assert f"the model that was in {earlier} is intact; the training state is in its last checkpoint" in err
    assert {name: d for name, d in digests(earlier).items() if name in MODEL_FILES} == old
    assert not list(earlier.glob(".tmp-*"))


def test_a_disk_too_small_for_the_run_is_said_before_training(corpus, tmp_path, in_process):  # noqa: F811
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        code, out, err = in_process("--train_file", corpus, "--output_dir", mount, *FINISHED)
        message = one_error(err)
        assert code == 2 and f"no space for this run in {mount}: it needs about " in message
        assert "2 checkpoint(s) of" in message and "step 1" not in out and os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# ---------------------------------------------------------------------------------------------- secrets
def test_the_hub_token_is_never_written_or_printed(finished):
    out, result = finished
    assert "warning: --hub_token puts the token on the command line" in result.stdout
    assert TOKEN not in result.stdout + result.stderr
    for path in out.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


def test_trackers_get_no_secret_flag():
    seen = {}
    accelerator = SimpleNamespace(init_trackers=lambda name, config: seen.update(config))
    args = SimpleNamespace(with_tracking=True, hub_token=TOKEN, api_key="k", wandb_password="p", max_new_tokens=20,
                           tokenizer_name="tok", recipe_choice=SimpleNamespace(section=lambda _: {"node_size": 8}))
    pretrain.init_tracking(args, accelerator)
    assert seen == {"with_tracking": True, "max_new_tokens": 20, "tokenizer_name": "tok", "model_node_size": 8}


# ---------------------------------------------------------------------------------------- no silent loss
def records(tmp_path, with_text: int, without: int) -> Path:
    path = tmp_path / "records.jsonl"
    rows = [{"text": f"The {w} sat on the mat and saw a dog."} for w in WORDS[:with_text]]
    rows += [{"title": "no text here"}] * without
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_records_without_the_text_field_are_refused_or_counted(tmp_path):
    from modeling_brillm.training.data import load_raw_data

    args = pretrain.parse_args(["--train_file", str(records(tmp_path, 20, 20))])
    pretrain.settle(args)
    with pytest.raises(UsageError, match=r"20 of the 40 train records have no 'text' field \(the first: record 21\); "
                                         "give every record one, or pass --skip_records_without_text"):
        load_raw_data(args)
    args.skip_records_without_text = True
    raw, description = load_raw_data(args)
    assert len(raw["train"]) + len(raw["validation"]) == 20 and None not in raw["train"]["text"]
    assert "20 train records without a 'text' field left out" in description


@pytest.mark.slow
def test_a_validation_set_too_small_or_empty_is_said(corpus, tmp_path, in_process):  # noqa: F811
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("The cat.\n")
    code, out, _ = in_process("--train_file", corpus, "--validation_file", tiny, "--output_dir", tmp_path / "a",
                              *TINY, "--max_train_steps", "2")
    assert code == 0 and re.search(r"warning: the validation set has \d scored tokens, too few to choose the best", out)
    assert "keeping the last model" in out and "kept the best model" not in out
    empty = tmp_path / "empty.txt"
    empty.write_text("a\nb\n")
    code, _, err = in_process("--train_file", corpus, "--validation_file", empty, "--output_dir", tmp_path / "b",
                              *TINY, "--max_train_steps", "2")
    assert code == 2 and f"--validation_file {empty} gives no validation block" in err
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------- a broken folder
@pytest.fixture
def model_copy(finished, tmp_path) -> Path:
    """The finished model's folder alone (no checkpoints), to break."""
    folder = tmp_path / "model"
    shutil.copytree(finished[0], folder, ignore=shutil.ignore_patterns("step_*"))
    return folder


@pytest.mark.parametrize("fault", ["nan", "truncated", "no tokenizer"])
@pytest.mark.parametrize("script", ["generate_cli", "perplexity_cli"])
def test_a_broken_folder_is_named_in_one_line(fault, script, model_copy, capsys):
    import importlib

    from safetensors.torch import load_file, save_file

    if fault == "nan":
        weights = load_file(model_copy / "model.safetensors")
        name = next(k for k in sorted(weights) if weights[k].is_floating_point())
        weights[name].view(-1)[0] = float("nan")
        save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
        expected = f"the weights are broken: {name} holds 1 NaN or infinite value(s)"
    elif fault == "truncated":
        text = (model_copy / "tokenizer.json").read_text()
        (model_copy / "tokenizer.json").write_text(text[: len(text) // 2])
        expected = f"{model_copy / 'tokenizer.json'} is truncated or corrupt"
    else:
        for path in model_copy.glob("tokenizer*"):
            path.unlink()
        expected = f"{model_copy} has no tokenizer (no tokenizer.json)"
    main = importlib.import_module(f"modeling_brillm.training.{script}").main
    argv = ["--model", str(model_copy)] + (["--text", "The cat sat.", "--no_metric"] if script == "perplexity_cli"
                                           else ["--prompt", "The cat", "--max_new_tokens", "3"])
    assert main(argv) == 2
    assert expected in one_error(capsys.readouterr().err)


def test_perplexity_refuses_a_path_that_does_not_exist(model_copy):
    from transformers import AutoTokenizer

    from modeling_brillm import BriLLMForCausalLM, perplexity

    model, tokenizer = BriLLMForCausalLM.from_pretrained(model_copy), AutoTokenizer.from_pretrained(model_copy)
    with pytest.raises(FileNotFoundError, match=r"/does/not/exist\.txt: no such file \(to score this string"):
        perplexity(model, tokenizer, "/does/not/exist.txt")
    assert perplexity(model, tokenizer, "The cat sat on the mat.").num_tokens > 0  # a text is still a text


def test_generate_without_the_package_never_runs_a_folders_code(model_copy):
    """The script says how to run a saved folder's own code; it does not turn trust_remote_code on itself."""
    probe = ("import runpy, sys; sys.modules['modeling_brillm'] = None; "
             f"sys.argv = ['generate.py', '--model', {str(model_copy)!r}]; "
             "runpy.run_path('examples/generate.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert "runs on the modeling_brillm package" in result.stderr and "if you trust that code" in result.stderr
    for script in (ROOT / "examples").glob("*.py"):
        assert "trust_remote_code=True" not in script.read_text().replace('trust_remote_code=True), if you', ""), \
            script
