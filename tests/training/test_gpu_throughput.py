"""benchmarks/gpu_throughput.py runs on a CPU (tiny shape, Triton column in the interpreter) and reports its rows."""

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
                       "--objective", "exact", "--optimizer", "sparse_adamw", "--steps", "1", "--warmup", "1",
                       "--decode-batches", "2", "--decode-tokens", "3", "--long-tokens", "12",
                       "--results_dir", str(tmp_path / "records")])
    out = capsys.readouterr().out
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["backend"] for r in train] == ["torch", "triton"]
    for r in train:
        assert r["tokens_per_s"] > 0 and r["launches"] > 0 and r["floor_ms"] > 0 and r["loss"] == r["loss"]
        assert r["interpreted"] == (r["backend"] == "triton" and not gpu)
    # the recurrence's per-column ops are gone under the scan: fewer host dispatches per step
    assert train[1]["launches"] < train[0]["launches"]
    assert {(r["kind"], r["backend"]) for r in rows if r["kind"] != "train"} == {
        ("decode", "torch"), ("decode", "triton"), ("long", "torch"), ("long", "triton")}
    assert ("(interpreted: not a speed figure)" in out) != gpu
    assert "| tiny | 2x6 | exact | sparse_adamw | torch |" in out
    assert sorted(r["sampled"] for r in rows if r["kind"] == "decode") == [False, False, True, True]


def test_batch_list_is_parsed_and_bad_input_is_refused():
    bench = load_bench()
    assert bench.parse_batches("32x32,1024x64") == [(32, 32), (1024, 64)]
    with pytest.raises(SystemExit, match="BxL"):
        bench.parse_batches("32by32")
