"""benchmarks/gpu_throughput.py runs on a CPU (tiny shape, Triton column in the interpreter) and reports its rows:
training steps, decoding in every decode mode; and pretrain.py's default
step beside the throughput record."""

import json

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


def test_the_default_batch_runs_and_records_beside_the_throughput(tmp_path, capsys):
    bench = load_bench()
    run = {"rows": [dict(kind="train", shape="paper", backend=backend, objective="exact", optimizer="sparse_adamw",
                         B=1024, L=64, tokens_per_s=speed, peak_gb=15.5) for backend, speed in
                    (("torch", 120_000.0), ("triton", 1_500_000.0))]}
    (tmp_path / "gpu_throughput-20990101T000000Z.json").write_text(json.dumps({"figures": run}))
    figures = bench.main(["--device", "cpu", "--shape", "tiny", "--default_batch", "1", "--corpus_tokens", "12000",
                          "--results_dir", str(tmp_path)])["default_batch"]
    assert figures["batch"] == 32 and figures["rule"] == "per_device_train_batch_size"  # the CPU's
    assert figures["tokens_per_s"] > 0 and figures["num_edges"] > 0
    assert figures["throughput_rows"] == [dict(batch="1024x64", tokens_per_s=1_500_000.0, peak_gb=15.5,
                                               optimizer="sparse_adamw")]
    (record,) = [p for p in tmp_path.glob("gpu_throughput-*.json") if "20990101" not in p.name]
    assert json.loads(record.read_text())["figures"]["default_batch"]["batch"] == 32
    assert "default batch 32 x 32" in capsys.readouterr().out
    committed, rows = bench.throughput_rows(tmp_path / "none")  # no run's record: the committed one
    assert committed.startswith("benchmarks/results/gpu_throughput-") and rows and all(r["tokens_per_s"] for r in rows)
