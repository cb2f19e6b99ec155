"""Decoding throughput: greedy tokens/s against context length, fast path and generate(), one sequence and a batch.

    python benchmarks/decode_throughput.py                  # both shapes
    python benchmarks/decode_throughput.py --shape paper --contexts 16 512

For every context length c a prompt of c - G tokens (a Zipf path) is read and G = min(64, c/2) tokens are decoded
greedily: the fast path (a loop of `model(next_token[:, None], cache=state, logits_to_keep=1)` and argmax);
generate() (its time minus the prompt's forward, with an EOS id the greedy path never picks, so every step runs with
the check a user's call makes); the same with `model.decode_mode = "off"` (the general path); and the fast path with
`--batch` sequences. Each figure is the median of `--repeats` runs (at least 256 decoded tokens), under
torch.inference_mode(), on the training benchmark's synthetic graphs.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, CpuMonitor, ZipfPaths, add_results_dir, machine, make_model, wait_for_quiet, write_record  # noqa: E402


def fast_decode(model, prompt, steps):
    out = model(prompt, use_cache=True, logits_to_keep=1)
    state, token = out.state, out.logits[:, -1].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(token[:, None], cache=state, logits_to_keep=1, use_cache=True)
        state, token = out.state, out.logits[:, -1].argmax(-1)
    return time.perf_counter() - t0


def unused_token(model, prompt, steps) -> int:
    """An id the greedy continuation of `prompt` never picks: generate()'s EOS id, so that it runs every step with
    the EOS check a user's call makes."""
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
    picked = set(out[:, prompt.shape[1]:].flatten().tolist())
    return next(t for t in range(model.config.vocab_size - 1, -1, -1) if t not in picked)


def generate_decode(model, prompt, steps, eos):
    t0 = time.perf_counter()
    model(prompt, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    total = time.perf_counter() - t0
    assert out.shape[1] == prompt.shape[1] + steps
    return max(total - prefill, 1e-9)


def run_shape(args, shape_name):
    shape = SHAPES[shape_name]
    model, graph = make_model(shape["vocab"], shape["successors"])
    model.eval()
    model.generation_config.pad_token_id = 0
    paths = ZipfPaths(graph, seed=2)
    rows = []
    with torch.inference_mode():
        warm = paths.batch(1, 8)
        fast_decode(model, warm, 20)
        generate_decode(model, warm, 8, None)
        for c in args.contexts:
            steps = min(64, c // 2)
            prompt = paths.batch(1, c - steps)
            batch_prompt = paths.batch(args.batch, c - steps)
            eos = unused_token(model, prompt, steps)
            if args.wait_quiet:
                wait_for_quiet()
            monitor = CpuMonitor()
            monitor.start()
            repeats = max(args.repeats, -(-256 // steps))  # at least 256 decoded tokens per figure
            fast = statistics.median(fast_decode(model, prompt, steps) for _ in range(repeats))
            gen = statistics.median(generate_decode(model, prompt, steps, eos) for _ in range(repeats))
            model.decode_mode = "off"  # the general one-token path, side by side: what the default step gains
            general = statistics.median(generate_decode(model, prompt, steps, eos) for _ in range(repeats))
            model.decode_mode = "auto"
            batched = statistics.median(fast_decode(model, batch_prompt, steps) for _ in range(args.repeats))
            row = dict(shape=shape_name, context=c, decoded=steps, fast_tokens_per_s=steps / fast,
                       generate_tokens_per_s=steps / gen, general_path_generate_tokens_per_s=steps / general,
                       batch=args.batch,
                       batched_tokens_per_s=args.batch * steps / batched, other_cpu_load=monitor.stop())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["paper", "small", "all"], default="all")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-wait-quiet", dest="wait_quiet", action="store_false", default=True,
                        help="do not wait (up to 5 min) for other processes to leave the CPUs before timing")
    args = add_results_dir(parser).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# machine: {machine()}")
    rows = []
    for shape in (["paper", "small"] if args.shape == "all" else [args.shape]):
        rows.extend(run_shape(args, shape))
    print()
    print(f"{'shape':6} {'context':>7} {'fast path tok/s':>15} {'generate() tok/s':>16} {'general path':>12} "
          f"{'batch':>5} {'batched tok/s':>13} {'other load':>10}")
    for r in rows:
        print(f"{r['shape']:6} {r['context']:7d} {r['fast_tokens_per_s']:15.0f} {r['generate_tokens_per_s']:16.0f} "
              f"{r['general_path_generate_tokens_per_s']:12.0f} {r['batch']:5d} {r['batched_tokens_per_s']:13.0f} "
              f"{r['other_cpu_load']:10.2f}")
    write_record("decode_throughput", args, dict(rows=rows))


if __name__ == "__main__":
    main()
