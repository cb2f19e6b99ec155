"""How evenly `--edge_sharding source` spreads the work over 8 owners, at the paper shape on a real corpus's graph.

    python benchmarks/corpora.py --corpus small --output_dir outputs/corpora      # git's manuals, offline
    python benchmarks/sharded_shares.py --corpus_dir outputs/corpora/small

A BPE tokenizer of V = 4,000 is trained on the corpus's training text, the text is cut into blocks of 64 tokens and
their bigrams make the sparse graph (every bigram seen `--min_count` times); the owners are the ones a sharded run
chooses (`ShardedBriLLM`'s balanced split by bigram count x successors). Then 8 gloo processes run `--steps`
training steps of the sharded model at d = 32 (`ShardedBriLLM.from_config`: forward, backward, the reduction of the
replicated gradients and the clipping; no optimizer, which sends nothing), 16 blocks a process a step as in
gpu8_sharded.yaml. Per owner: the edge rows it holds, the positions it scores a step (those whose source it owns),
the candidate energies those cost (each position's successors: the work the split balances) and the bytes it
sends a step (the transport's count: ids, rows, signals and their gradients, the all-reduces). Each figure is
printed as largest over mean: the busiest owner sets the step's pace and its memory.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_results_dir, machine, write_record  # noqa: E402


def corpus_blocks(corpus_dir: str, vocab_size: int, block: int) -> tuple[torch.Tensor, int]:
    """(blocks (N, block) of token ids of the corpus's training text, the tokenizer's vocabulary size)."""
    from tokenization import build_tokenizer

    with open(os.path.join(corpus_dir, "train.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size)
    ids = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]])
    return ids[: len(ids) // block * block].view(-1, block), len(tokenizer)


def _rank_main(rank, world, folder, steps, batch):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    from modeling_brillm.sharding import ShardedBriLLM

    saved = torch.load(os.path.join(folder, "inputs.pt"), weights_only=False)
    sharded = ShardedBriLLM.from_config(saved["config"], saved["graph"])
    blocks, sent, scored = saved["blocks"], [], []
    for step in range(steps):
        ids = blocks[step * batch * world:(step + 1) * batch * world].tensor_split(world)[rank]
        before = sharded.bytes_sent
        out = sharded(ids, labels=ids)
        out.loss.backward()
        sharded.reduce_gradients()
        sharded.clip_grad_norm_(1.0)
        sharded.zero_grad(set_to_none=True)
        sent.append(sharded.bytes_sent - before)
        scored.append(out.owned_targets)
    rows = int(sharded.model.base_model.weights.shape[0]) - 1
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"edge_rows": rows, "scored_per_step": scored, "bytes_per_step": sent,
                   "owners": sharded.owners.tolist()}, f)
    torch.distributed.destroy_process_group()


def spread(values) -> float:
    """Largest over mean."""
    return max(values) / (sum(values) / len(values))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus_dir", required=True, help="a corpus folder of benchmarks/corpora.py (train.jsonl)")
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--vocab_size", type=int, default=4000)
    p.add_argument("--node_size", type=int, default=32)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="blocks per process and step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--min_count", type=int, default=1, help="the graph keeps the bigrams seen this often")
    args = add_results_dir(p).parse_args(argv)
    from modeling_brillm import BriLLMConfig, build_sparse_graph

    print(machine())
    blocks, vocab = corpus_blocks(args.corpus_dir, args.vocab_size, args.block_size)
    blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))]
    W = args.processes
    if len(blocks) < args.steps * args.batch * W:
        raise SystemExit(f"error: {len(blocks)} blocks cannot fill {args.steps} steps of {args.batch} x {W}; "
                         "lower --steps or --batch.")
    graph = build_sparse_graph(blocks.tolist(), vocab, min_count=args.min_count)
    config = BriLLMConfig(vocab_size=vocab, node_size=args.node_size, graph="sparse", num_edges=graph.num_edges,
                          max_position_embeddings=args.block_size)
    print(f"{args.corpus_dir}: {len(blocks):,} blocks of {args.block_size}, V = {vocab:,}, {graph.num_edges:,} edges "
          f"(bigrams seen >= {args.min_count}x), d = {args.node_size}; {W} owners, {args.batch} blocks a process")
    with tempfile.TemporaryDirectory() as folder:
        torch.save({"config": config, "graph": graph, "blocks": blocks}, os.path.join(folder, "inputs.pt"))
        mp.start_processes(_rank_main, args=(W, folder, args.steps, args.batch), nprocs=W, join=True,
                           start_method="spawn")
        ranks = [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(W)]
    # every position but a block's last is scored, by the owner of its token: the candidates are its successors
    sources = blocks[: args.steps * args.batch * W, :-1].reshape(-1)
    owner = torch.tensor(ranks[0]["owners"])[sources]
    assert torch.bincount(owner, minlength=W).tolist() == [sum(r["scored_per_step"]) for r in ranks]
    candidates = torch.zeros(W, dtype=torch.float64).index_add_(0, owner, graph.indptr.diff()[sources].double())
    per_owner = {"edge_rows": [r["edge_rows"] for r in ranks],
                 "tokens_per_step": [sum(r["scored_per_step"]) / args.steps for r in ranks],
                 "candidates_per_step": (candidates / args.steps).tolist(),
                 "bytes_per_step": [sum(r["bytes_per_step"]) / args.steps for r in ranks]}
    figures = {"vocab_size": vocab, "num_edges": graph.num_edges, "blocks": len(blocks), "per_owner": per_owner,
               "largest_over_mean": {k: spread(v) for k, v in per_owner.items()},
               "worst_step_largest_over_mean": {
                   k: max(spread([r[key][s] for r in ranks]) for s in range(args.steps))
                   for k, key in (("tokens_per_step", "scored_per_step"), ("bytes_per_step", "bytes_per_step"))}}
    for name, values in per_owner.items():
        print(f"{name:<20} largest/mean {figures['largest_over_mean'][name]:.3f}   per owner: "
              + " ".join(f"{v:,.0f}" for v in values))
    print("worst single step, largest/mean: " + ", ".join(
        f"{k} {v:.3f}" for k, v in figures["worst_step_largest_over_mean"].items()))
    write_record("sharded_shares", args, figures, argv=argv)


if __name__ == "__main__":
    main()
