"""Unbounded context: per-token time and memory of one 20,000-token generation (`position_overflow="extend"`).

    python benchmarks/long_context.py                          # synthetic V=4000, d=32 graph, 20,000 tokens
    python benchmarks/long_context.py --model outputs/demo     # a saved model (the demo's)
    python benchmarks/long_context.py --tokens 5000 --ways generate

BriLLM's state is O(d) per sequence: a token costs the same at position 20,000 as at 10. For each way of decoding one
sequence greedily from a 1-token prompt (`generate`, `energy` = energy_generate, `loop` = a bare loop of
`model(token, cache=state)`), one call generates `--tokens` tokens, recording a timestamp and the memory (RSS, or
allocated CUDA memory) after every token: the per-token median and mean of the first and the last `--window` tokens,
and the memory after 1,000 tokens and at the end. The synthetic graph has `--successors` real successors per node.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_results_dir, machine, make_model, rss_gb, write_record  # noqa: E402


class Clock:
    """A streamer: `put` is called with the prompt, then once per new token; records time and memory per token."""

    def __init__(self, device):
        self.device, self.times, self.memory, self.prompt_seen = device, [], [], False

    def memory_now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 1e9
        return rss_gb()

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            self.t0 = time.perf_counter()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        if len(self.times) % 100 == 0:
            self.memory.append((len(self.times), self.memory_now()))

    def end(self):
        pass


def run_loop(model, prompt, steps, clock):
    clock.put(prompt)
    out = model(prompt, use_cache=True, logits_to_keep=1)
    state, token = out.state, out.logits[:, -1].argmax(-1)
    for _ in range(steps):
        clock.put(token)
        out = model(token[:, None], cache=state, logits_to_keep=1, use_cache=True)
        state, token = out.state, out.logits[:, -1].argmax(-1)


def measure(model, way: str, steps: int, window: int) -> dict:
    device = model.device
    prompt = torch.tensor([[1]], device=device)
    clock = Clock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start_memory = clock.memory_now()
    with torch.inference_mode():
        if way == "generate":
            out = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, streamer=clock,
                                 eos_token_id=None, pad_token_id=0)
            assert out.shape[1] == steps + 1, out.shape
        elif way == "energy":
            out = model.energy_generate(prompt, max_new_tokens=steps, eos_token_id=[], streamer=clock,
                                        num_alternatives=0)
            assert out.sequences.shape[1] == steps + 1, out.sequences.shape
        else:
            run_loop(model, prompt, steps, clock)
    times = [clock.t0] + clock.times
    per_token = [b - a for a, b in zip(times, times[1:])]
    first, last = statistics.median(per_token[:window]), statistics.median(per_token[-window:])
    first_mean, last_mean = statistics.fmean(per_token[:window]), statistics.fmean(per_token[-window:])
    memory = dict(clock.memory)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else max(memory.values())
    return {
        "way": way, "tokens": len(per_token), "first_ms": first * 1e3, "last_ms": last * 1e3, "ratio": last / first,
        "first_mean_ms": first_mean * 1e3, "last_mean_ms": last_mean * 1e3, "mean_ratio": last_mean / first_mean,
        "total_s": times[-1] - times[0], "memory_start_gb": start_memory,
        "memory_at_1000_gb": memory.get(min(1000, max(memory))), "memory_end_gb": memory[max(memory)],
        "memory_peak_gb": peak,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a saved BriLLM folder (default: a synthetic graph)")
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--successors", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000, help="tokens at each end whose per-token time is compared")
    ways = ["generate", "energy", "loop"]
    parser.add_argument("--ways", nargs="+", default=ways, choices=ways)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the results here")
    args = add_results_dir(parser).parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        from modeling_brillm import BriLLMForCausalLM

        model = BriLLMForCausalLM.from_pretrained(args.model)
        shape = f"{args.model} (V={model.config.vocab_size}, d={model.config.node_size}, E={model.config.num_edges:,})"
    else:
        model, _ = make_model(args.vocab, args.successors)
        shape = f"synthetic V={args.vocab}, d=32, {args.successors} successors per node (E={model.config.num_edges:,})"
    model.config.position_overflow = "extend"
    model.generation_config.eos_token_id = None
    model = model.to(args.device).eval()
    print(f"{shape}; max_position_embeddings={model.config.max_position_embeddings}; {machine()}; "
          f"device {args.device}")
    results = []
    for way in args.ways:
        r = measure(model, way, args.tokens, args.window)
        results.append(r)
        print(f"{way:9s} {r['tokens']:,} tokens in {r['total_s']:.1f}s: per token (median) {r['first_ms']:.3f} ms "
              f"(first "
              f"{args.window:,}) -> {r['last_ms']:.3f} ms (last {args.window:,}), ratio {r['ratio']:.2f} (means "
              f"{r['first_mean_ms']:.3f} -> {r['last_mean_ms']:.3f} ms, ratio {r['mean_ratio']:.2f}); memory "
              f"{r['memory_at_1000_gb']:.3f} GB after 1,000 -> {r['memory_end_gb']:.3f} GB at the end "
              f"(peak {r['memory_peak_gb']:.3f} GB, {'CUDA allocated' if args.device.startswith('cuda') else 'RSS'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "machine": machine(), "results": results}, f, indent=1)
    write_record("long_context", args, {"shape": shape, "results": results}, argv=argv)
    return results


if __name__ == "__main__":
    main()
