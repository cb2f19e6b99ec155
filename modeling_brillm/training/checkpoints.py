"""Checkpoints and the training log: listing and resolving `step_N` folders, atomic saves (a temporary folder,
then one rename), and the jsonl log of steps and evaluations."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from .errors import UsageError

LOG_NAME = "train_log.jsonl"
STATE_NAME = "train_state.json"
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"


def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """Complete checkpoints (step_N folders holding train_state.json), oldest first."""
    found = []
    if os.path.isdir(output_dir):
        for entry in os.scandir(output_dir):
            match = CHECKPOINT_RE.match(entry.name)
            if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, STATE_NAME)):
                found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def resolve_checkpoint(args) -> Path | None:
    if not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint == "latest":
        found = list_checkpoints(args.output_dir)
        return found[-1][1] if found else None
    path = Path(args.resume_from_checkpoint)
    if not path.is_dir():
        raise UsageError(f"--resume_from_checkpoint {path}: no such folder.")
    if not (path / STATE_NAME).is_file():
        raise UsageError(f"--resume_from_checkpoint {path}: not a complete checkpoint (no {STATE_NAME}).")
    return path


def remove_dir(path: Path):
    """Delete a folder so that a crash midway never leaves something that looks like a checkpoint."""
    doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_checkpoint(accelerator, output_dir: str, step: int, state: dict, tokenizer, limit: int | None,
                    write_extra=None) -> Path:
    """accelerator.save_state into a temporary folder, then one rename: step_N is complete or absent.
    `write_extra(tmp)`, called on every process before the rename, adds files (the recipe, a sharded run's shards)."""
    final = Path(output_dir) / f"step_{step}"
    tmp = Path(output_dir) / f"{TMP_PREFIX}step_{step}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if write_extra is not None:
        write_extra(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp / "tokenizer")
        with open(tmp / STATE_NAME, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            remove_dir(final)
        os.replace(tmp, final)
        if limit:
            for _, old in list_checkpoints(output_dir)[:-limit]:
                remove_dir(old)
    accelerator.wait_for_everyone()
    return final


def read_log(path) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def prepare_output_dir(output_dir, checkpoint: Path | None, resume_requested: bool, accelerator) -> Path:
    """Create `output_dir` and clear the debris of killed saves. A run that does not resume removes the
    checkpoints and the log of an earlier run there (they would mix with this one's)."""
    out_dir = Path(output_dir)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        for entry in out_dir.glob(TMP_PREFIX + "*"):  # debris of a run killed while saving
            shutil.rmtree(entry, ignore_errors=True)
        if resume_requested and checkpoint is None:
            accelerator.print(f"--resume_from_checkpoint latest: no checkpoint in {out_dir}, starting from scratch.")
        if checkpoint is None:
            _clear_earlier_run(out_dir, accelerator.print)
    accelerator.wait_for_everyone()
    return out_dir


def _clear_earlier_run(out_dir: Path, say):
    stale = list_checkpoints(out_dir)
    if stale:
        say(f"removing {len(stale)} checkpoint(s) of an earlier run in {out_dir} (this run starts over; use "
            "--resume_from_checkpoint latest to continue one).")
    for _, path in stale:
        remove_dir(path)
    if os.path.exists(out_dir / LOG_NAME):
        os.remove(out_dir / LOG_NAME)


def load_checkpoint(accelerator, checkpoint: Path) -> dict:
    """Restore model, optimizer, scheduler and RNG states (`accelerator.load_state`); return the train state."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as err:
        raise UsageError(
            f"could not restore {checkpoint}: {type(err).__name__}: {str(err).splitlines()[0]}. Was it saved "
            "by a run with the same data, tokenizer and graph?"
        ) from None
    return read_train_state(checkpoint)


def read_train_state(checkpoint) -> dict:
    """A checkpoint's train state: its position, clock, planned epochs, signature and best model."""
    with open(Path(checkpoint) / STATE_NAME, encoding="utf-8") as handle:
        return json.load(handle)


class TrainLog:
    """`<output_dir>/train_log.jsonl`, one JSON record per line, written by the main process; records also go to
    the experiment trackers when `tracking` is on."""

    def __init__(self, output_dir, accelerator, tracking: bool = False):
        self.path = Path(output_dir) / LOG_NAME
        self.accelerator, self.tracking = accelerator, tracking

    def truncate(self, last_step: int):
        """Keep what happened up to `last_step` (the checkpoint a run resumes from)."""
        if self.accelerator.is_main_process:
            kept = [r for r in read_log(self.path) if r.get("step", 0) <= last_step]
            with open(self.path, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in kept)

    def __call__(self, record: dict):
        if self.accelerator.is_main_process:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.tracking:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
