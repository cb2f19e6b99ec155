"""A run's output folder (`RunFolder`: its lock, the earlier run it may replace, the final model staged and swapped
in), its checkpoints (`step_N`: a temporary folder renamed whole) and its train log (every line whole or absent)."""

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from accelerate.utils import broadcast_object_list

from .errors import UsageError, first_line
from .memory import human_bytes

LOG_NAME, STATE_NAME, LOCK_NAME, BEST_FILE = "train_log.jsonl", "train_state.json", ".lock", "best_model.safetensors"
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
MODEL_FILE = re.compile(r".+\.(safetensors|json|py|model|tiktoken)|README\.md|merges\.txt")  # what a save writes
RESUME = "free space and continue with --resume_from_checkpoint latest"


# ------------------------------------------------------------------------------------------------- writing
@contextmanager
def writing(folder, what: str, fix: str, need: float = 0.0, cleanup=None):
    """A write into `folder`: a disk that ran out of space (the error says so, or, as torch.save does not, less than
    `need` bytes are free) is one line naming the folder, `what` and `fix`; `cleanup` first removes what it left."""
    try:
        yield
    except Exception as err:
        said = getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err) or "os error 28" in str(err)
        full = said or shutil.disk_usage(folder).free < need
        if cleanup is not None:
            cleanup()
        if not full:
            raise
        size = f"about {human_bytes(need)}; " if need else ""
        free = human_bytes(shutil.disk_usage(folder).free)
        raise UsageError(f"no space left in {folder} for {what} ({size}{free} free): {fix}.") from None


def write_json(path: Path, data):
    """`path` written whole or not at all: a temporary file, flushed to disk, then renamed."""
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def remove_dir(path: Path):
    """Delete a folder so that a crash midway never leaves something that looks like a checkpoint."""
    doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# --------------------------------------------------------------------------------------------- the folder
class RunFolder(AbstractContextManager):
    """`--output_dir`, this run's from `lock` to `release` (a flock on `.lock`, which names its holder; a dead run's
    is taken over). An earlier run is refused unless `--overwrite_output_dir`; its model stays until `install`."""

    def __init__(self, path):
        self.path, self.handle, self.created = Path(path), None, not Path(path).exists()
        self.staged = self.path / f"{TMP_PREFIX}final"

    def lock(self, say=print):
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / LOCK_NAME
        while self.handle is None:
            handle = open(lock, "a+", encoding="utf-8")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise UsageError(f"--output_dir {self.path} is in use by another run ({holder}): wait for it to end, "
                                 "or choose another --output_dir.") from None
            if lock.exists() and lock.stat().st_ino == os.fstat(handle.fileno()).st_ino:
                self.handle = handle
            else:  # the holder removed its lock as this process opened it: take the new one
                handle.close()
        self.handle.seek(0)
        if left := self.handle.read().strip():
            say(f"taking over the lock of a run that ended without releasing it ({left})")
        self.handle.truncate(0)
        self.handle.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
        self.handle.flush()
        for debris in self.path.glob(TMP_PREFIX + "*"):  # of saves killed midway: no other run writes here now
            if debris.is_dir():
                shutil.rmtree(debris)
            else:
                debris.unlink()

    def release(self):
        if self.handle is None:  # not the holder (another process of the run), or released
            return
        (self.path / LOCK_NAME).unlink(missing_ok=True)
        self.handle.close()
        self.handle = None
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()  # a run refused before it wrote anything leaves no folder behind

    def __exit__(self, *exc):
        self.release()

    def model_files(self) -> list[Path]:
        return [p for p in self.path.iterdir() if p.is_file() and MODEL_FILE.fullmatch(p.name) and p.name != BEST_FILE]

    def refuse_earlier_run(self, overwrite: bool, resumable: bool = True):
        """What an earlier run left (its checkpoints, log, model) is refused without `overwrite`."""
        n = len(list_checkpoints(self.path))
        found = [what for what, there in ((f"{n} checkpoint(s)", n), ("a train log", (self.path / LOG_NAME).exists()),
                                          ("a saved model", self.model_files())) if there]
        if found and not overwrite:
            resumable = resumable and "checkpoint" in found[0]
            resume = "continue it with --resume_from_checkpoint latest, " if resumable else ""
            raise UsageError(f"--output_dir {self.path} holds an earlier run ({', '.join(found)}): {resume}replace it "
                             "with --overwrite_output_dir (its model stays until the new one is saved), or choose "
                             "another --output_dir.")

    def claim(self, need: float, what: str, fresh: bool = True, say=print):
        """With room for `need` bytes (`what` says of what), a `fresh` run removes the earlier run's checkpoints, log
        and best model (its model stays until `install`)."""
        old = [path for _, path in list_checkpoints(self.path)] if fresh else []
        freed = sum(p.stat().st_size for folder in old for p in folder.rglob("*") if p.is_file())
        free = shutil.disk_usage(self.path).free + freed
        if need > free:
            raise UsageError(f"no space for this run in {self.path}: it needs about {human_bytes(need)} ({what}), "
                             f"{human_bytes(free)} is free; free space or choose another --output_dir.")
        if old:
            say(f"removing {len(old)} checkpoint(s) of the earlier run in {self.path} (--overwrite_output_dir; its "
                "model stays until this run's is saved)")
        for path in old:
            remove_dir(path)
        for name in (LOG_NAME, BEST_FILE) if fresh else ():
            (self.path / name).unlink(missing_ok=True)

    @contextmanager
    def staging(self, accelerator, what: str, fix: str, need: float = 0.0):
        """A `writing` of the new model into the emptied staged folder, which `install` swaps in; yields that folder."""
        if accelerator.is_main_process:
            self.unstage()
            self.staged.mkdir()
        accelerator.wait_for_everyone()
        with writing(self.path, what, fix, need, cleanup=self.unstage):
            yield self.staged

    def unstage(self):
        shutil.rmtree(self.staged, ignore_errors=True)

    def install(self):
        """The staged model in place of the old one: the old config goes first and the new one comes last, so a crash
        midway leaves a folder that does not load, never one that mixes two runs."""
        new = sorted(p.name for p in self.staged.iterdir())
        (self.path / "config.json").unlink(missing_ok=True)
        for path in self.model_files():
            if path.name not in new:
                path.unlink()
        for name in sorted(new, key=lambda name: name == "config.json"):
            os.replace(self.staged / name, self.path / name)
        self.staged.rmdir()


def open_folder(path, accelerator, overwrite: bool, resuming_here: bool = False, resumable: bool = True) -> RunFolder:
    """`path` locked by the main process, an earlier run there refused unless `overwrite` (or the run resumes its
    checkpoint; `resumable`: whether the message may offer that); a refusal stops every process."""
    folder, error = RunFolder(path), None
    if accelerator.is_main_process:
        try:
            folder.lock(accelerator.print)
            if not resuming_here:
                folder.refuse_earlier_run(overwrite, resumable)
        except UsageError as err:
            folder.release()
            error = str(err)
    if accelerator.num_processes > 1:
        error = broadcast_object_list([error])[0]
    if error:
        raise UsageError(error)
    return folder


# ------------------------------------------------------------------------------------------- checkpoints
def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """Complete checkpoints (step_N folders holding train_state.json), oldest first."""
    return sorted((int(match.group(1)), path) for path in Path(output_dir).glob("step_*")
                  if (match := CHECKPOINT_RE.match(path.name)) and (path / STATE_NAME).is_file())


def read_train_state(checkpoint) -> dict:
    """A checkpoint's train state: its position, clock, planned epochs, signature and best model."""
    path = Path(checkpoint) / STATE_NAME
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        state = first_line(err)
    if not isinstance(state, dict) or "completed_steps" not in state:
        raise UsageError(f"{path} is corrupt ({state if isinstance(state, str) else 'no completed_steps'}): resume "
                         "from another checkpoint, or start over.")
    return state


def resolve_checkpoint(args, say=print) -> Path | None:
    """The checkpoint `--resume_from_checkpoint` names ('latest': the newest whose train state reads), or None."""
    if not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint != "latest":
        path = Path(args.resume_from_checkpoint)
        if not path.is_dir():
            raise UsageError(f"--resume_from_checkpoint {path}: no such folder.")
        if not (path / STATE_NAME).is_file():
            raise UsageError(f"--resume_from_checkpoint {path}: not a complete checkpoint (no {STATE_NAME}).")
        read_train_state(path)
        return path
    for _, path in reversed(list_checkpoints(args.output_dir)):
        try:
            read_train_state(path)
            return path
        except UsageError as err:
            say(f"warning: skipping {path.name}: {err}")
    say(f"--resume_from_checkpoint latest: no checkpoint in {args.output_dir}, starting from scratch.")
    return None


def save_checkpoint(accelerator, output_dir: str, step: int, state: dict, tokenizer, limit: int | None,
                    write_extra=None, need: float = 0.0) -> Path:
    """accelerator.save_state into a temporary folder, then one rename: step_N is complete or absent, and the older
    ones go only then. `write_extra(tmp)`, on every process before the rename, adds files (the recipe, shards)."""
    final = Path(output_dir) / f"step_{step}"
    tmp = final.with_name(TMP_PREFIX + final.name)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    with writing(output_dir, f"checkpoint {final.name}", "the checkpoints before it are intact; " + RESUME, need,
                 cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        accelerator.save_state(str(tmp), safe_serialization=True)
        if write_extra is not None:
            write_extra(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            tokenizer.save_pretrained(tmp / "tokenizer")
            write_json(tmp / STATE_NAME, state)
    if accelerator.is_main_process:
        if final.exists():
            remove_dir(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(output_dir)[:-limit] if limit else []:
            remove_dir(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, checkpoint: Path) -> dict:
    """Restore model, optimizer, scheduler and RNG states (`accelerator.load_state`); return the train state."""
    state = read_train_state(checkpoint)
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as err:
        raise UsageError(f"could not restore {checkpoint}: {first_line(err)}. Was it saved by a run with the same "
                         "data, tokenizer and graph?") from None
    return state


# --------------------------------------------------------------------------------------------- the log
def read_log(path) -> list[dict]:
    """The records of a train log; a torn last line (a crash while it was written) is read past, with a warning."""
    if not os.path.isfile(path):
        return []
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError:
            if number < len(lines):
                raise UsageError(f"{path}, line {number}: not a JSON record; the log is corrupt.") from None
            print(f"warning: the last line of {path} is torn (a crash while it was written): read past it",
                  file=sys.stderr)
    return records


def append_line(path: Path, record: dict):
    """One record appended whole, or not at all: a short write is cut back off."""
    line = (json.dumps(record) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, "No space left on device (a short write)")
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


class TrainLog:
    """`<output_dir>/train_log.jsonl`, one JSON record per line (main process), and the trackers' with `tracking`."""

    def __init__(self, output_dir, accelerator, tracking: bool = False):
        self.path = Path(output_dir) / LOG_NAME
        self.accelerator, self.tracking = accelerator, tracking

    def truncate(self, last_step: int):
        """Keep what happened up to `last_step` (the checkpoint a run resumes from)."""
        if self.accelerator.is_main_process:
            kept = "".join(json.dumps(r) + "\n" for r in read_log(self.path) if r.get("step", 0) <= last_step)
            tmp = self.path.with_name(TMP_PREFIX + LOG_NAME)
            tmp.write_text(kept, encoding="utf-8")
            os.replace(tmp, self.path)

    def __call__(self, record: dict):
        if self.accelerator.is_main_process:
            with writing(self.path.parent, "the train log", "the checkpoints are intact; " + RESUME):
                append_line(self.path, record)
        if self.tracking:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
