"""benchmarks/gpu_throughput.py runs on a CPU (tiny shape, Triton column in the interpreter) and reports its rows:
training steps and decoding in every decode mode (its --default_batch: tests/training/test_device_batch.py)."""

import pytest
import torch

from modeling_brillm.backend import HAVE_TRITON
from tests._scripts import load_script


def load_bench():
    return load_script("benchmarks/gpu_throughput.py", "gpu_throughput")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_benchmark_smoke_runs_both_backends(capsys, tmp_path):
    gpu = torch.cuda.is_available()  # without one: the CPU, the Triton column interpreted (conftest.py)
    bench = load_bench()
    rows = bench.main(["--device", "cuda" if gpu else "cpu", "--shape", "tiny", "--batches", "2x6",
                       "--objective", "exact", "--optimizer", "sparse_adamw",
                       "--steps", "1", "--warmup", "1", "--decode-batches", "2", "--decode-tokens", "3",
                       "--decode_modes", "off,eager,auto",
                       "--results_dir", str(tmp_path / "records")])["rows"]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["backend"] for r in train] == ["torch", "triton"]
    for r in train:
        assert r["tokens_per_s"] > 0 and r["launches"] > 0 and r["floor_ms"] > 0 and r["loss"] == r["loss"]
        assert r["interpreted"] == (r["backend"] == "triton" and not gpu)
    # the recurrence's per-column ops are gone under the scan: fewer host dispatches per step
    assert train[1]["launches"] < train[0]["launches"]
    decode = [r for r in rows if r["kind"] == "decode"]
    assert sorted((r["backend"], r["mode"], r["sampled"]) for r in decode) == sorted(
        (b, m, s) for b in ("torch", "triton") for m in ("off", "eager", "auto") for s in (False, True))
    assert all(r["same_tokens"] for r in decode if not r["sampled"])  # every mode decodes the same greedy tokens
    assert '"kind": "train", "B": 2, "L": 6, "objective": "exact"' in capsys.readouterr().out


def test_batch_list_is_parsed_and_bad_input_is_refused():
    bench = load_bench()
    assert bench.parse_batches("32x32,1024x64") == [(32, 32), (1024, 64)]
    with pytest.raises(SystemExit, match="BxL"):
        bench.parse_batches("32by32")
