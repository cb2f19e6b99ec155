"""Shared pieces of the benchmark scripts: synthetic graphs and Zipf token paths, CPU load, and `write_record`.

A synthetic graph has exactly `successors` real successors per node (distinct targets drawn uniformly, self loops
allowed), with bigram counts falling off as 1/rank over a random order of each node's successors. Token paths start
at a Zipf-distributed node and walk real edges, each successor picked with Zipf weights, so every pair is a real edge.
`write_record` ends every benchmark: one JSON file per run, `benchmarks/results/<benchmark>-<UTC time>.json`, with the
command line, the commit, the machine, the arguments and the figures.
"""

import argparse
import datetime
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# the checkout whose modeling_brillm is measured: this repository, or BRILLM_ROOT (to compare another copy)
ROOT = os.environ.get("BRILLM_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from modeling_brillm import BriLLMForCausalLM, graph_from_edges  # noqa: E402

SHAPES = {
    # name: vocab, successors per node, batch, length (the paper's English shape and a small one)
    "paper": dict(vocab=4000, successors=227, batch=32, length=32),
    "small": dict(vocab=1000, successors=100, batch=32, length=32),
}


def synthetic_graph(vocab: int, successors: int, seed: int = 0, zipf_s: float = 1.0):
    """CSR graph with exactly `successors` real successors per node and 1/rank bigram counts."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(vocab, vocab, generator=g)
    targets = scores.topk(successors, dim=1).indices  # (V, k) distinct successors, random order = frequency rank
    ranks = torch.arange(1, successors + 1, dtype=torch.float64)
    counts = (1_000_000 / ranks.pow(zipf_s)).round().long().expand(vocab, successors)
    sources = torch.arange(vocab).unsqueeze(1).expand(vocab, successors)
    return graph_from_edges(sources.reshape(-1), targets.reshape(-1), vocab, counts.reshape(-1))


class ZipfPaths:
    """Batches of token paths along the real edges of `graph`, Zipf start nodes and Zipf successor choice."""

    def __init__(self, graph, seed: int = 0, zipf_s: float = 1.0):
        self.graph = graph
        V = graph.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        start_rank = torch.randperm(V, generator=self.gen)  # which node has which frequency rank
        self.start_weights = torch.empty(V, dtype=torch.float64)
        self.start_weights[start_rank] = 1.0 / torch.arange(1, V + 1, dtype=torch.float64).pow(zipf_s)
        indptr, counts = graph.indptr, graph.counts.double()
        self.indptr, self.indices = indptr, graph.indices
        degree = indptr.diff()
        if int(degree.min()) <= 0:
            raise ValueError("every node needs a successor for the walks")
        k = int(degree.max())
        # per node, cumulative successor probabilities (padded) for inverse-CDF sampling
        table = torch.zeros(V, k, dtype=torch.float64)
        src = torch.repeat_interleave(torch.arange(V), degree)
        within = torch.arange(indptr[-1]) - indptr[src]
        table[src, within] = counts.clamp_min(1)
        cdf = table.cumsum(1)
        cdf /= cdf[:, -1:].clone()
        self.cdf, self.degree = cdf, degree

    def batch(self, batch: int, length: int) -> torch.Tensor:
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.multinomial(self.start_weights, batch, replacement=True, generator=self.gen)
        for j in range(1, length):
            u = tokens[:, j - 1]
            r = torch.rand(batch, 1, generator=self.gen, dtype=torch.float64)
            pick = torch.searchsorted(self.cdf[u], r).squeeze(1).clamp_max(self.degree[u] - 1)
            tokens[:, j] = self.indices[self.indptr[u] + pick]
        return tokens


def make_model(vocab: int, successors: int, seed: int = 0, node_size: int = 32, **config):
    graph = synthetic_graph(vocab, successors, seed)
    torch.manual_seed(seed)
    model = BriLLMForCausalLM.from_graph(graph, node_size=node_size, **config)
    return model, graph


def peak_rss_gb() -> float:
    """High-water resident set size of this process (resource.getrusage ru_maxrss, KiB on Linux), in GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def machine() -> str:
    return f"{os.cpu_count()}-core {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _cpu_ticks():
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields[:8]) - idle  # busy ticks of the whole machine


def _own_ticks():
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])  # utime stime cutime cstime


class CpuMonitor:
    """CPU cores used by *other* processes between start() and stop() (machine busy minus this process)."""

    def start(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), _cpu_ticks(), _own_ticks()

    def stop(self) -> float:
        try:
            hz = os.sysconf("SC_CLK_TCK")
            elapsed = time.perf_counter() - self.t0
            others = (_cpu_ticks() - self.busy0) - (_own_ticks() - self.own0)
            return max(0.0, others / hz / max(elapsed, 1e-9))
        except (OSError, AttributeError, ValueError):
            return float("nan")


def wait_for_quiet(max_wait_s: float = 300.0, window_s: float = 2.0, threshold: float = 0.15) -> float:
    """Block until other processes used < `threshold` cores over a `window_s` window (or `max_wait_s` passed).

    The benchmark machine is shared; figures taken while another process computes are meaningless (two torch
    processes on two cores make every parallel region wait for a descheduled thread). Returns the load seen.
    """
    deadline = time.perf_counter() + max_wait_s
    while True:
        mon = CpuMonitor()
        mon.start()
        time.sleep(window_s)
        load = mon.stop()
        if load < threshold or time.perf_counter() > deadline:
            return load


RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_results_dir(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--results_dir`: where `write_record` puts this run's JSON record."""
    parser.add_argument("--results_dir", default=str(RESULTS_DIR),
                        help="write this run's record (argv, commit, machine, arguments, figures) here as "
                             "<benchmark>-<UTC time>.json")
    return parser


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> dict:
    """The commit of the measured checkout (ROOT) and whether tracked files differ from it."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        name = None
    return name or platform.processor() or "unknown CPU"


def machine_info() -> dict:
    """The machine a record was measured on, as data."""
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers_version, "cuda_device": cuda}


def _plain(value):
    """`value` as strict JSON: tensors and tuples as lists, paths as strings (relative to the repository where they
    lie in it, so a record reads the same on any checkout), NaN and infinities as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int)):
        return value
    return str(value).replace(os.path.join(ROOT, ""), "")


def write_record(benchmark: str, args, figures, results_dir=None, argv=None) -> Path:
    """Write this run's record to `results_dir` (default: `args.results_dir`, else benchmarks/results) atomically
    (a temporary file renamed into place) and return its path. `args`: the parsed arguments (Namespace or dict);
    `figures`: what the run printed, as data; `argv`: the arguments a `main(argv)` was called with (default: the
    process's command line)."""
    arguments = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    folder = Path(results_dir or arguments.get("results_dir") or RESULTS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    command = list(sys.argv) if argv is None else [f"benchmarks/{benchmark}.py", *map(str, argv)]
    record = {"benchmark": benchmark, "time_utc": now.isoformat(timespec="seconds"), "argv": command,
              **git_state(), "machine": machine_info(), "arguments": arguments, "figures": figures}
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    path, n = folder / f"{benchmark}-{stamp}.json", 1
    while path.exists():  # two runs in one second keep both records
        n += 1
        path = folder / f"{benchmark}-{stamp}-{n}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{benchmark}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(_plain(record), handle, indent=1, allow_nan=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"# record: {path}", flush=True)
    return path
