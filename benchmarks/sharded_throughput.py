"""Source-sharded training against DDP and one process on the same synthetic batches, each mode in fresh processes;
or (--shares CORPUS) how evenly 8 owners share the sharded work on a real corpus's graph, each figure the busiest
owner's over the mean (the modes and figures: docs/benchmarks.md, docs/training.md).

    python benchmarks/sharded_throughput.py                       # both shapes
    python benchmarks/sharded_throughput.py --shares outputs/corpora/small    # benchmarks/corpora.py --corpus small
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

SHAPES = {"paper": common.SHAPES["paper"], "text": dict(vocab=2000, successors=48, batch=64, length=64)}


def _step_fn(model, mode):
    """(the model a step runs, its optimizer, the ShardedBriLLM or None)."""
    from modeling_brillm.optimization import SparseAdamW
    from modeling_brillm.sharding import ShardedBriLLM

    if mode == "sharded":
        sharded = ShardedBriLLM(model)
        return sharded, SparseAdamW(sharded.parameter_groups(), lr=1e-3), sharded
    model.sparse_gradients = mode.startswith("single-sparse")
    if model.sparse_gradients:
        return model, SparseAdamW(model.parameters(), lr=1e-3), None
    ddp = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    return ddp, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), None


def _rank_main(rank, world, mode, shape_name, steps, warmup, folder):
    torch.set_num_threads(1 if world > 1 or mode.endswith("-1t") else 2)
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    shape = SHAPES[shape_name]
    model, graph = common.make_model(shape["vocab"], shape["successors"])
    paths, P = common.ZipfPaths(graph, seed=1), sum(p.numel() for p in model.parameters())
    rows = torch.arange(shape["batch"]).tensor_split(world)[rank]
    step_fn, optimizer, sharded = _step_fn(model, mode)
    times, sent, cpu = [], [], []
    for i, tokens in enumerate([paths.batch(shape["batch"], shape["length"]) for _ in range(warmup + steps)]):
        ids = tokens[rows]
        if world > 1:
            torch.distributed.barrier()
        before, t0, c0 = sharded.bytes_sent if sharded else 0, time.perf_counter(), time.process_time()
        step_fn(ids, labels=ids, **({} if sharded else {"return_logits": False})).loss.backward()
        if sharded:
            sharded.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            sent.append(sharded.bytes_sent - before if sharded else 2 * (world - 1) / world * 4 * P)
    local = (sharded.model if sharded else model).base_model.weights.shape[0]
    with open(os.path.join(folder, f"{mode}-{rank}.json"), "w") as f:
        json.dump({"median_s": statistics.median(times), "cpu_s": statistics.median(cpu), "local_rows": int(local),
                   "bytes_per_step": statistics.median(sent), "peak_gb": common.peak_rss_gb()}, f)
    if world > 1:
        torch.distributed.destroy_process_group()


def run_mode(mode, shape_name, args) -> dict:
    world = 2 if mode in ("ddp", "sharded") else 1
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1" if world > 1 or mode.endswith("-1t") else "2")
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode, "--shape", shape_name,
                               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", tmp], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return {"mode": mode, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        ranks = [json.load(open(os.path.join(tmp, f"{mode}-{r}.json"))) for r in range(world)]
    shape, step = SHAPES[shape_name], max(r["median_s"] for r in ranks)
    return {"mode": mode, "processes": world, "tokens_per_s": shape["batch"] * shape["length"] / step, "step_s": step,
            "cpu_s": [round(r["cpu_s"], 3) for r in ranks], "bytes_per_step": max(r["bytes_per_step"] for r in ranks),
            "peak_gb": [round(r["peak_gb"], 2) for r in ranks], "local_rows": [r["local_rows"] for r in ranks],
            "wall_s": time.perf_counter() - started}


def throughput(args) -> dict:
    figures = {}
    for shape_name in args.shape:
        results = []
        for mode in args.modes:
            if mode == "ddp" and shape_name == "paper" and not args.ddp_paper:
                print(f"{shape_name} {mode}: skipped (2 x ~19 GB; --ddp-paper to try)")
                continue
            load = float("nan") if args.no_wait_quiet else common.wait_for_quiet()
            results.append(dict(run_mode(mode, shape_name, args), other_cpu_load=load))
            print(shape_name, json.dumps(results[-1]), flush=True)
        figures[shape_name] = dict(SHAPES[shape_name], modes=[r for r in results if "error" not in r])
    return figures


def _owner_main(rank, world, folder, steps, batch):
    """One owner of --shares: `steps` sharded steps of its blocks; what it holds, scores and sends."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    from modeling_brillm.sharding import ShardedBriLLM

    saved = torch.load(os.path.join(folder, "inputs.pt"), weights_only=False)
    sharded, sent, scored = ShardedBriLLM.from_config(saved["config"], saved["graph"]), [], []
    for step in range(steps):
        ids = saved["blocks"][step * batch * world:(step + 1) * batch * world].tensor_split(world)[rank]
        before = sharded.bytes_sent
        out = sharded(ids, labels=ids)
        out.loss.backward()
        sharded.reduce_gradients()
        sharded.clip_grad_norm_(1.0)
        sharded.zero_grad(set_to_none=True)
        sent.append(sharded.bytes_sent - before)
        scored.append(out.owned_targets)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"edge_rows": int(sharded.model.base_model.weights.shape[0]) - 1, "scored_per_step": scored,
                   "bytes_per_step": sent, "owners": sharded.owners.tolist()}, f)
    torch.distributed.destroy_process_group()


def corpus_blocks(args) -> tuple[torch.Tensor, int]:
    """(blocks of the corpus's training text, shuffled, the tokenizer's vocabulary size)."""
    from tokenization import build_tokenizer

    with open(os.path.join(args.shares, "train.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tokenizer = build_tokenizer(texts, vocab_size=args.vocab_size)
    ids = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]])
    blocks = ids[: len(ids) // args.block_size * args.block_size].view(-1, args.block_size)
    return blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))], len(tokenizer)


def shares(args) -> dict:
    from modeling_brillm import BriLLMConfig, build_sparse_graph

    blocks, vocab = corpus_blocks(args)
    W, B, steps = args.processes, args.batch, args.steps
    if len(blocks) < steps * B * W:
        raise SystemExit(f"error: {len(blocks)} blocks cannot fill {steps} steps of {B} x {W}; lower --steps.")
    graph = build_sparse_graph(blocks.tolist(), vocab, min_count=args.min_count)
    config = BriLLMConfig(vocab_size=vocab, node_size=32, graph="sparse", num_edges=graph.num_edges,
                          max_position_embeddings=args.block_size)
    print(f"{args.shares}: {len(blocks):,} blocks, V = {vocab:,}, {graph.num_edges:,} edges; {W} owners")
    with tempfile.TemporaryDirectory() as folder:
        torch.save({"config": config, "graph": graph, "blocks": blocks}, os.path.join(folder, "inputs.pt"))
        mp.start_processes(_owner_main, args=(W, folder, steps, B), nprocs=W, join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(W)]
    # every position but a block's last is scored by the owner of its token: its candidates are its successors
    sources = blocks[: steps * B * W, :-1].reshape(-1)
    owner = torch.tensor(ranks[0]["owners"])[sources]
    assert torch.bincount(owner, minlength=W).tolist() == [sum(r["scored_per_step"]) for r in ranks]
    candidates = torch.zeros(W, dtype=torch.float64).index_add_(0, owner, graph.indptr.diff()[sources].double())
    per_owner = {"edge_rows": [r["edge_rows"] for r in ranks],
                 "tokens_per_step": [sum(r["scored_per_step"]) / steps for r in ranks],
                 "candidates_per_step": (candidates / steps).tolist(),
                 "bytes_per_step": [sum(r["bytes_per_step"]) / steps for r in ranks]}
    spread = lambda values: max(values) / (sum(values) / len(values))  # largest over mean
    figures = {"vocab_size": vocab, "num_edges": graph.num_edges, "blocks": len(blocks), "per_owner": per_owner,
               "largest_over_mean": {k: spread(v) for k, v in per_owner.items()},
               "worst_step_largest_over_mean": {k: max(spread([r[key][s] for r in ranks]) for s in range(steps)) for k,
                                                key in (("tokens_per_step", "scored_per_step"),
                                                        ("bytes_per_step", "bytes_per_step"))}}
    print(json.dumps({k: figures[k] for k in ("largest_over_mean", "worst_step_largest_over_mean")}))
    return figures


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), nargs="+", default=["text", "paper"])
    p.add_argument("--modes", nargs="+", default=["single-sparse", "single-dense", "ddp", "sharded"],
                   help="single-sparse (SparseAdamW; -1t: 1 thread), single-dense (AdamW), ddp, sharded")
    p.add_argument("--steps", type=int, help="timed steps (default 6; --shares: 4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ddp-paper", action="store_true", help="also DDP at the paper shape (~38 GB of RAM)")
    p.add_argument("--no-wait-quiet", action="store_true")
    p.add_argument("--shares", metavar="CORPUS", help="a corpus folder of benchmarks/corpora.py (train.jsonl)")
    p.add_argument("--processes", type=int, default=8, help="--shares: owners")
    p.add_argument("--vocab_size", type=int, default=4000, help="--shares")
    p.add_argument("--block_size", type=int, default=64, help="--shares")
    p.add_argument("--batch", type=int, default=16, help="--shares: blocks per process and step")
    p.add_argument("--min_count", type=int, default=1, help="--shares: the graph keeps the bigrams seen this often")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = common.add_results_dir(p).parse_args(argv)
    args.steps = args.steps or (4 if args.shares else 6)
    if args.worker:
        world = 2 if args.worker in ("ddp", "sharded") else 1
        job = (world, args.worker, args.shape[0], args.steps, args.warmup, args.out)
        if world == 1:
            return _rank_main(0, *job)
        return mp.start_processes(_rank_main, args=job, nprocs=world, join=True, start_method="spawn")
    print(common.machine())
    figures = shares(args) if args.shares else throughput(args)
    common.write_record("sharded_throughput", args, figures, argv=argv)


if __name__ == "__main__":
    main()
