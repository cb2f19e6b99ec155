"""The benchmarks' shared parts: synthetic graphs and Zipf token paths along their edges, the CPU load others cause,
and `write_record`, which ends every benchmark: benchmarks/results/<benchmark>-<UTC time>.json, the command line,
commit, machine, arguments and figures of the run.
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
import time
from pathlib import Path

import torch

# the checkout whose modeling_brillm is measured: this repository, or BRILLM_ROOT (to compare another copy)
ROOT = os.environ.get("BRILLM_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from modeling_brillm import BriLLMForCausalLM, graph_from_edges  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHAPES = {"paper": dict(vocab=4000, successors=227, batch=32, length=32),  # the paper's English shape
          "small": dict(vocab=1000, successors=100, batch=32, length=32)}


def synthetic_graph(vocab: int, successors: int):
    """Exactly `successors` successors per node, drawn uniformly, their counts falling off as 1/rank."""
    g = torch.Generator().manual_seed(0)
    targets = torch.rand(vocab, vocab, generator=g).topk(successors, dim=1).indices  # random order = frequency rank
    counts = (1_000_000 / torch.arange(1, successors + 1, dtype=torch.float64)).round().long().expand(vocab, -1)
    sources = torch.arange(vocab).unsqueeze(1).expand(vocab, successors)
    return graph_from_edges(sources.reshape(-1), targets.reshape(-1), vocab, counts.reshape(-1))


class ZipfPaths:
    """Batches of token paths along the real edges of `graph`: Zipf start nodes, successors by their counts."""

    def __init__(self, graph, seed: int = 0):
        V, indptr = graph.vocab_size, graph.indptr
        self.gen = torch.Generator().manual_seed(seed)
        self.start_weights = torch.empty(V, dtype=torch.float64)
        self.start_weights[torch.randperm(V, generator=self.gen)] = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
        self.indptr, self.indices, self.degree = indptr, graph.indices, indptr.diff()
        if int(self.degree.min()) <= 0:
            raise ValueError("every node needs a successor for the walks")
        table = torch.zeros(V, int(self.degree.max()), dtype=torch.float64)  # each node's counts, padded
        src = torch.repeat_interleave(torch.arange(V), self.degree)
        table[src, torch.arange(indptr[-1]) - indptr[src]] = graph.counts.double().clamp_min(1)
        cdf = table.cumsum(1)
        self.cdf = cdf / cdf[:, -1:]  # for inverse-CDF sampling

    def batch(self, batch: int, length: int) -> torch.Tensor:
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.multinomial(self.start_weights, batch, replacement=True, generator=self.gen)
        for j in range(1, length):
            u = tokens[:, j - 1]
            r = torch.rand(batch, 1, generator=self.gen, dtype=torch.float64)
            pick = torch.searchsorted(self.cdf[u], r).squeeze(1).clamp_max(self.degree[u] - 1)
            tokens[:, j] = self.indices[self.indptr[u] + pick]
        return tokens


def make_model(vocab: int, successors: int, node_size: int = 32):
    graph = synthetic_graph(vocab, successors)
    torch.manual_seed(0)
    return BriLLMForCausalLM.from_graph(graph, node_size=node_size), graph


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def rss_gb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def machine() -> str:
    return f"{os.cpu_count()}-core {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process and its finished children)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return sum(fields[:8]) - fields[3] - fields[4], sum(int(v) for v in own[11:15])


def other_cpu_load():
    """A function giving the CPU cores *other* processes used since this call (the machine's busy time minus ours)."""
    t0, (busy0, own0) = time.perf_counter(), _ticks()

    def since() -> float:
        try:
            (busy, own), elapsed = _ticks(), max(time.perf_counter() - t0, 1e-9)
            return max(0.0, ((busy - busy0) - (own - own0)) / os.sysconf("SC_CLK_TCK") / elapsed)
        except (OSError, ValueError):
            return float("nan")

    return since


def wait_for_quiet(max_wait_s: float = 300.0, window_s: float = 2.0, threshold: float = 0.15) -> float:
    """Wait until other processes use under `threshold` cores (or `max_wait_s` passed): the load seen."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        others = other_cpu_load()
        time.sleep(window_s)
        load = others()
        if load < threshold or time.perf_counter() > deadline:
            return load


def add_results_dir(parser: argparse.ArgumentParser, wait_quiet: bool = False) -> argparse.ArgumentParser:
    """--results_dir (every benchmark's) and, with `wait_quiet`, --no-wait-quiet (args.wait_quiet)."""
    parser.add_argument("--results_dir", default=str(RESULTS_DIR), help="where this run's record goes")
    if wait_quiet:
        parser.add_argument("--no-wait-quiet", "--no_wait_quiet", dest="wait_quiet", action="store_false",
                            help="do not wait for other processes to leave the CPUs")
    return parser


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        return None
    return done.stdout.strip()


def machine_info() -> dict:
    import transformers

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _plain(value):
    """`value` as strict JSON: tensors and tuples as lists, NaN and infinities as null, other objects as text (paths
    inside the repository relative to it, so that a record reads the same on any checkout)."""
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
    """Write this run's record into `results_dir` (default `args.results_dir`) whole and return its path; `argv`: the
    arguments a `main(argv)` was given (default: the process's command line)."""
    arguments = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    folder = Path(results_dir or arguments.get("results_dir") or RESULTS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    record = {"benchmark": benchmark, "time_utc": now.isoformat(timespec="seconds"),
              "argv": list(sys.argv) if argv is None else [f"benchmarks/{benchmark}.py", *map(str, argv)],
              "commit": commit, "dirty": None if status is None else bool(status), "machine": machine_info(),
              "arguments": arguments, "figures": figures}
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    path, n = folder / f"{benchmark}-{stamp}.json", 1
    while path.exists():  # two runs in one second keep both records
        n += 1
        path = folder / f"{benchmark}-{stamp}-{n}.json"
    tmp = path.with_name(f".tmp-{path.name}")  # the record whole or not at all
    tmp.write_text(json.dumps(_plain(record), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    print(f"# record: {path}", flush=True)
    return path
