"""Decoding throughput: greedy tokens/s by context length, or (--long N) per-token time and memory over N tokens
(each figure: docs/benchmarks.md).

    python benchmarks/decode_throughput.py --contexts 16 128 512              # both shapes
    python benchmarks/decode_throughput.py --long 20000                       # three ways, 20,000 tokens
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, ZipfPaths, add_results_dir, make_model, other_cpu_load, rss_gb, wait_for_quiet, write_record


def fast_decode(model, prompt, steps, put=lambda token: None):
    out = model(prompt, use_cache=True, logits_to_keep=1)
    state, token = out.state, out.logits[:, -1].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        put(token)
        out = model(token[:, None], cache=state, logits_to_keep=1, use_cache=True)
        state, token = out.state, out.logits[:, -1].argmax(-1)
    return time.perf_counter() - t0


def unused_token(model, prompt, steps) -> int:
    """An id the greedy continuation of `prompt` never picks: generate()'s EOS id."""
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
    picked = set(out[:, prompt.shape[1]:].flatten().tolist())
    return next(t for t in range(model.config.vocab_size - 1, -1, -1) if t not in picked)


def generate_decode(model, prompt, steps, eos):
    t0 = time.perf_counter()
    model(prompt, use_cache=True, logits_to_keep=1)
    prefill, t0 = time.perf_counter() - t0, time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    assert out.shape[1] == prompt.shape[1] + steps
    return max(time.perf_counter() - t0 - prefill, 1e-9)


def context_row(args, model, paths, c) -> dict:
    steps = min(64, c // 2)
    prompt, batch_prompt = paths.batch(1, c - steps), paths.batch(args.batch, c - steps)
    eos = unused_token(model, prompt, steps)
    if args.wait_quiet:
        wait_for_quiet()
    others = other_cpu_load()
    repeats = max(args.repeats, -(-256 // steps))
    fast = statistics.median(fast_decode(model, prompt, steps) for _ in range(repeats))
    gen = statistics.median(generate_decode(model, prompt, steps, eos) for _ in range(repeats))
    model.decode_mode = "off"  # the general one-token path, side by side: what the default step gains
    general = statistics.median(generate_decode(model, prompt, steps, eos) for _ in range(repeats))
    model.decode_mode = "auto"
    batched = statistics.median(fast_decode(model, batch_prompt, steps) for _ in range(args.repeats))
    return dict(context=c, decoded=steps, fast_tokens_per_s=steps / fast, generate_tokens_per_s=steps / gen,
                general_path_generate_tokens_per_s=steps / general, batch=args.batch,
                batched_tokens_per_s=args.batch * steps / batched, other_cpu_load=others())


def context_rows(args) -> dict:
    rows = []
    for shape_name in ["paper", "small"] if args.shape == "all" else [args.shape]:
        shape = SHAPES[shape_name]
        model, graph = make_model(shape["vocab"], shape["successors"])
        model.eval().generation_config.pad_token_id = 0
        paths = ZipfPaths(graph, seed=2)
        with torch.inference_mode():
            warm = paths.batch(1, 8)
            fast_decode(model, warm, 20)
            generate_decode(model, warm, 8, None)
            for c in args.contexts:
                rows.append(dict(shape=shape_name, **context_row(args, model, paths, c)))
                print(json.dumps(rows[-1]), flush=True)
    return dict(rows=rows)


class Clock:
    """A streamer (`put`: the prompt, then each new token) that records the time and, every 100 tokens, the memory."""

    def __init__(self, device):
        self.device, self.cuda, self.times, self.memory = device, device.type == "cuda", [], {}

    def put(self, value):
        if self.cuda and self.times:
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        tokens = len(self.times) - 1
        if tokens and tokens % 100 == 0:
            self.memory[tokens] = torch.cuda.memory_allocated(self.device) / 1e9 if self.cuda else rss_gb()

    def end(self):
        pass


def measure_long(model, way: str, steps: int, window: int) -> dict:
    prompt, clock = torch.tensor([[1]], device=model.device), Clock(model.device)
    with torch.inference_mode():
        if way == "generate":
            model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, streamer=clock,
                           eos_token_id=None, pad_token_id=0)
        elif way == "energy":
            model.energy_generate(prompt, max_new_tokens=steps, eos_token_id=[], streamer=clock, num_alternatives=0)
        else:
            clock.put(prompt)
            fast_decode(model, prompt, steps, clock.put)
    times, memory = clock.times, clock.memory
    assert len(times) == steps + 1, len(times)  # the prompt's, then every token's
    gaps = [b - a for a, b in zip(times, times[1:])]
    ms = {f"{end}_{kind}ms": f(part) * 1e3 for end, part in (("first", gaps[:window]), ("last", gaps[-window:]))
          for kind, f in (("", statistics.median), ("mean_", statistics.fmean))}
    return {"way": way, "tokens": len(gaps), "total_s": times[-1] - times[0], **ms,
            "memory_at_1000_gb": memory[min(1000, max(memory))], "memory_end_gb": memory[max(memory)]}


def long_rows(args) -> dict:
    model, _ = make_model(args.vocab, args.successors)
    shape = f"synthetic V={args.vocab}, d=32, {args.successors} successors per node (E={model.config.num_edges:,})"
    model.config.position_overflow = "extend"
    model.generation_config.eos_token_id = None
    model = model.to(args.device).eval()
    print(f"{shape}; device {args.device}")
    results = []
    for way in args.ways:
        results.append(r := measure_long(model, way, args.long, args.window))
        print(f"{way:9s} {r['tokens']:,} tokens in {r['total_s']:.1f} s: per token {r['first_ms']:.3f} -> "
              f"{r['last_ms']:.3f} ms (medians), {r['first_mean_ms']:.3f} -> {r['last_mean_ms']:.3f} ms (means); "
              f"memory {r['memory_at_1000_gb']:.3f} GB after 1,000 -> {r['memory_end_gb']:.3f} GB", flush=True)
    return {"shape": shape, "results": results}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["paper", "small", "all"], default="all")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 with --long)")
    parser.add_argument("--long", type=int, default=0, metavar="N", help="one N-token generation instead")
    parser.add_argument("--window", type=int, default=1000, help="--long: tokens at each end compared")
    ways = ["generate", "energy", "loop"]
    parser.add_argument("--ways", nargs="+", default=ways, choices=ways, help="--long's")
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--successors", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="--long's")
    args = add_results_dir(parser, wait_quiet=True).parse_args(argv)
    threads = args.threads or (1 if args.long else None)
    if threads:
        torch.set_num_threads(threads)
    figures = long_rows(args) if args.long else context_rows(args)
    write_record("decode_throughput", args, figures, argv=argv)
    return figures


if __name__ == "__main__":
    main()
