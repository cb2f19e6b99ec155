"""benchmarks/gpu_check.sh's quality step end to end on the CPU at tiny settings (GPU_CHECK_ON_CPU=1): the carried
corpus unpacked, BriLLM at two node sizes beside two GPT-2 sizes in one quality.py run, its record and picture; a
missing corpus is a clear line; the script stays inside its own time."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys

import pytest

from tests._scripts import ROOT
from tests._tiny import CORPUS


def check(tmp_path, *steps, corpus=True, seconds=None):
    data = tmp_path / "gpu"
    if corpus:
        (data / "joined").mkdir(parents=True)
        words = " ".join(CORPUS).split()
        lines = [" ".join(words[(7 * i) % len(words):][:9]) + "." for i in range(300)]
        for split, texts in (("train", lines), ("validation", CORPUS)):
            with lzma.open(data / "joined" / f"{split}.jsonl.xz", "wt", encoding="utf-8") as handle:
                handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    env = {**os.environ, "GPU_CHECK_ON_CPU": "1", "PYTHON": sys.executable, "GPU_DATA": str(data)}
    if seconds is not None:
        env["GPU_CHECK_SECONDS"] = str(seconds)
    results = tmp_path / "results"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(results), *steps], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    return done, results


@pytest.mark.slow
def test_the_quality_step_runs_on_the_cpu_and_records(tmp_path):
    done, results = check(tmp_path, "quality")
    assert done.returncode == 0, done.stdout + done.stderr + (results / "gpu_check-quality.log").read_text()[-3000:]
    assert done.stdout.startswith("quality        ok")
    (record,) = results.glob("quality-*.json")
    figures = json.loads(record.read_text())["figures"]
    labels = [m["label"] for m in figures["models"]]
    assert labels == ["BriLLM d=4", "BriLLM d=8", "GPT-2 1L 16w 2h", "GPT-2 2L 16w 2h"]
    assert all(m["curve"][-1]["train_seconds"] >= 0.5 for m in figures["models"])
    assert {m["batch_size"] for m in figures["models"][2:]} == {8}
    assert all("--no-keep_best_model" in m["pretrain_command"] for m in figures["models"][:2])
    assert (results / "quality.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((results / "quality.json").read_text())["models"] == figures["models"]
    assert "the best BriLLM" in (results / "gpu_check-quality.log").read_text()


def test_without_the_corpus_or_the_time_a_step_says_so(tmp_path):
    done, _ = check(tmp_path, "quality", corpus=False)
    assert done.returncode == 1 and "skipped: no corpus" in done.stdout and "gpu_prepare.sh" in done.stdout
    done, _ = check(tmp_path / "late", "quality", seconds=5)
    assert "quality        skipped: the script is out of its time" in done.stdout
