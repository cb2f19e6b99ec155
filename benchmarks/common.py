"""Shared pieces of the benchmark scripts: synthetic graphs, Zipf token paths, timing and memory helpers.

A synthetic graph has exactly `successors` real successors per node (distinct targets drawn uniformly, self
loops allowed), with bigram counts that fall off as 1/rank over a random order of each node's successors.
Token paths start at a Zipf-distributed node and walk real edges, picking each successor with Zipf weights
(1/rank) over that node's successor list, so every token pair of a batch is a real edge.
"""

import os
import resource
import sys
import time

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
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {name}, torch {torch.__version__}, {torch.get_num_threads()} threads"


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


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
