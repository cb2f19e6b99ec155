"""The command line of `examples/generate.py`: BriLLM's energy decoding, transformers' generate(), or the pipeline."""

import argparse
import json
import sys
import timeit

import torch
from transformers import TextStreamer, pipeline

from modeling_brillm.decoding import energy_generate

from .errors import CLI_ERRORS, load_model, load_tokenizer, run_cli


def parse_args(argv=None) -> argparse.Namespace:  # a flag list: exempt from the function length
    p = argparse.ArgumentParser(description="Generate text with a saved BriLLM. Modes: energy (energy_generate: the "
                                "next node is the one whose incoming edge delivers the most energy, self-loops "
                                "excluded as in the release; records the energy path), generate (model.generate()), "
                                "pipeline (pipeline('text-generation')).")
    p.add_argument("--model", required=True, help="saved model folder or Hub id")
    p.add_argument("--prompt", nargs="*", default=[""], help="one or more prompts (default: unconditional, from BOS)")
    p.add_argument("--mode", choices=("energy", "generate", "pipeline"), default="energy")
    p.add_argument("--max_new_tokens", type=int, default=40)
    p.add_argument("--do_sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--no_repeat_ngram_size", type=int, default=0)
    p.add_argument("--allow_self_loops", action="store_true", help="energy mode: allow moving from a node to itself")
    p.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams (greedy only)")
    p.add_argument("--num_return_sequences", type=int, default=1, help="beam search: sequences per prompt")
    p.add_argument("--length_penalty", type=float, default=1.0,
                   help="beam search: exponent of the length normalisation (> 0 favours longer sequences)")
    p.add_argument("--early_stopping", choices=("true", "false", "never"), default="false",
                   help="beam search: when a prompt's search ends (as generate()'s early_stopping)")
    p.add_argument("--stop_strings", "--stop", dest="stop", nargs="*", default=None,
                   help="strings that end a sequence (at the token completing one)")
    p.add_argument("--extend", action="store_true",
                   help='read and generate past max_position_embeddings (sets config.position_overflow="extend")')
    p.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--show_path", action="store_true", help="energy mode: print every step's energy and rank")
    p.add_argument("--json", default=None, help="energy mode: write texts and energy paths to this JSON file")
    p.add_argument("--benchmark", action="store_true", help="time energy_generate against generate()")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_cli(parse_args, run, argv, CLI_ERRORS)


def run(args) -> int:
    """The prompts' continuations in --mode (with --benchmark, the timing record instead)."""
    model, tokenizer = load_saved(args.model, args.extend, args.seed)
    if args.benchmark:
        torch.set_num_threads(1)
        print(json.dumps(benchmark(model, tokenizer, args.prompt[0], args.max_new_tokens)))
        return 0
    enc, max_new = encode(model, tokenizer, args.prompt, args.max_new_tokens)
    if args.stream and len(args.prompt) != 1:
        raise ValueError("--stream prints one sequence: give a single prompt.")
    streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True) if args.stream else None
    (run_energy if args.mode == "energy" else run_transformers)(args, model, tokenizer, enc, max_new, streamer)
    return 0


def load_saved(path, extend: bool, seed: int | None = None):
    """The model and tokenizer (the installed package answers for the brillm type), with --extend and --seed."""
    tokenizer = load_tokenizer(path, "save the tokenizer beside the model")
    model = load_model(path).eval()
    if extend:
        model.config.position_overflow = "extend"
    if reads_past_range(model):  # the tokenizer's model_max_length (the trained range) would warn falsely
        tokenizer.model_max_length = int(1e30)
    if seed is not None:
        torch.manual_seed(seed)
    return model, tokenizer


def reads_past_range(model) -> bool:
    return getattr(model.config, "position_overflow", "error") == "extend"


def encode(model, tokenizer, prompts: list[str], max_new_tokens: int):
    """(the left-padded prompts, max_new_tokens lowered to what fits unless the model reads past its range)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(1).tolist()
    if min(lengths) == 0:
        raise ValueError("an empty prompt tokenizes to no token and this tokenizer adds no BOS token: give some text.")
    longest, max_positions = max(lengths), model.config.max_position_embeddings
    if reads_past_range(model):
        return enc, max_new_tokens
    if longest > max_positions:
        raise ValueError(f"the prompt holds {longest} tokens but this model reads at most max_position_embeddings="
                         f"{max_positions}; shorten the prompt, or pass --extend to read past the trained range.")
    room = max_positions - longest
    if max_new_tokens > room:
        print(f"note: max_new_tokens={max_new_tokens} lowered to {room}: a prompt of {longest} tokens leaves room for "
              f"{room} new ones (max_position_embeddings={max_positions}).", file=sys.stderr)
    return enc, min(max_new_tokens, room)


def benchmark(model, tokenizer, prompt: str, n: int) -> dict:
    """Tokens per second of energy_generate and of generate() (best of 3 after a warm-up), and whether they agree."""
    enc, n = encode(model, tokenizer, [prompt], n)
    ids = enc["input_ids"]
    runs = {"energy_generate": lambda: energy_generate(model, ids, max_new_tokens=n, eos_token_id=[],
                                                       exclude_self_loops=False).sequences,
            "generate": lambda: model.generate(ids, attention_mask=enc["attention_mask"], max_new_tokens=n,
                                               min_new_tokens=n, do_sample=False, eos_token_id=None,
                                               pad_token_id=tokenizer.pad_token_id)}
    result, outputs = {"new_tokens": n}, {}
    for name, run in runs.items():
        outputs[name] = run()  # warm-up
        result[f"{name}_tokens_per_s"] = round(n / min(timeit.repeat(run, number=1, repeat=3)), 1)
    result["same_tokens"] = bool(torch.equal(outputs["energy_generate"], outputs["generate"]))
    return result


def decoding_options(args) -> dict:
    """The sampling and beam-search keywords shared by every mode."""
    options = dict(do_sample=args.do_sample, num_beams=args.num_beams, num_return_sequences=args.num_return_sequences)
    if args.do_sample:
        options.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.num_beams > 1:
        options.update(length_penalty=args.length_penalty,
                       early_stopping={"true": True, "false": False}.get(args.early_stopping, args.early_stopping))
    return options


def run_energy(args, model, tokenizer, enc, max_new, streamer):
    """--mode energy: `energy_generate`, the texts, the energy paths (--show_path) and the --json record."""
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    out = energy_generate(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new,
                          repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
                          exclude_self_loops=not args.allow_self_loops, generator=generator, streamer=streamer,
                          tokenizer=tokenizer, stop_strings=args.stop or None, **decoding_options(args))
    texts = tokenizer.batch_decode(out.sequences, skip_special_tokens=True)
    for row, text in enumerate(texts):
        if not args.stream:
            print(text)
        if args.show_path and out.sequences_scores is not None:
            print(f"  beam score {float(out.sequences_scores[row]):.4f}")
        for step in out.path(row) if args.show_path else ():
            alts = ", ".join(f"{t!r}:{a[1]:.2f}" for t, a in zip(step.alternative_texts, step.alternatives))
            print(f"  {step.source_text!r:>8} -> {step.token_text!r:<8} energy {step.energy:8.3f}  "
                  f"rank {step.rank:<4d} p {step.probability:.3f}  runner-ups: {alts}")
    if args.json:
        record = {"prompts": args.prompt, "texts": texts, "paths": out.to_records()}
        if out.sequences_scores is not None:  # beams: rows grouped by prompt, num_return_sequences each
            record["sequences_scores"] = out.sequences_scores.tolist()
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)


def run_transformers(args, model, tokenizer, enc, max_new, streamer):
    """--mode generate (`model.generate()`) or pipeline (`pipeline("text-generation")`)."""
    kwargs = dict(max_new_tokens=max_new, streamer=streamer, **decoding_options(args))
    if args.stop:
        kwargs.update(stop_strings=args.stop, tokenizer=tokenizer)
    if args.mode == "generate":
        out = model.generate(**enc, repetition_penalty=args.repetition_penalty,
                             no_repeat_ngram_size=args.no_repeat_ngram_size or None, **kwargs)
        texts = tokenizer.batch_decode(out, skip_special_tokens=True)
    else:
        results = pipeline("text-generation", model=model, tokenizer=tokenizer)(
            args.prompt, batch_size=len(args.prompt), **kwargs)
        texts = [candidate["generated_text"] for r in results for candidate in r]
    if not args.stream:
        print("\n".join(texts))
