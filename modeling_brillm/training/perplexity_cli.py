"""The command line of `examples/perplexity.py`: the built-in, token-weighted perplexity and the `evaluate` metric's
mean of per-text perplexities. The imported package registers the brillm type: no trust_remote_code for the metric."""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig

from modeling_brillm.evaluation import load_texts, per_text_perplexity, perplexity

from .errors import CLI_ERRORS, first_line, run_cli
from .generate_cli import load_saved, reads_past_range


def read_texts(args) -> list[str]:
    texts = list(args.text or [])
    if args.texts:
        texts += load_texts(Path(args.texts))  # a path, never a text to score
    if args.dataset:
        import datasets

        texts += datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)[args.text_column]
    texts = [t for t in texts if t and t.strip()][: args.limit or None]
    if not texts:
        raise ValueError("no texts: give --text, --texts FILE or --dataset.")
    return texts


def metric_perplexity(model_dir, texts, batch_size, max_length, model, tokenizer, in_process=False):
    """(result, source): the Hub metric when it can be loaded, else (or with in_process) the same steps in-process."""
    if not in_process:
        try:
            import evaluate

            metric = evaluate.load("perplexity", module_type="metric")
        except Exception as error:  # offline, hub unreachable, or evaluate missing
            print(f"note: the `evaluate` perplexity metric could not be loaded ({first_line(error)}); it is downloaded "
                  "from the Hub at run time. Running the metric's steps in-process instead (same numbers).",
                  file=sys.stderr)
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            result = metric.compute(predictions=texts, model_id=model_dir, batch_size=batch_size, add_start_token=True,
                                    max_length=max_length, device=device)
            return {"perplexities": list(map(float, result["perplexities"])),
                    "mean_perplexity": float(result["mean_perplexity"])}, "evaluate"
    return per_text_perplexity(model, tokenizer, texts, batch_size=batch_size, max_length=max_length), "in-process"


def parse_args(argv=None) -> argparse.Namespace:  # a flag list: exempt from the function length
    p = argparse.ArgumentParser(description="Perplexity of a saved BriLLM: the built-in token-weighted one and the "
                                "evaluate metric's mean of per-text perplexities.")
    p.add_argument("--model", required=True, help="saved model folder (the metric needs a folder or Hub id)")
    p.add_argument("--text", action="append", help="a text (repeatable)")
    p.add_argument("--texts", help="file with one text per line")
    p.add_argument("--dataset", help="a datasets id (needs the Hub or a local cache)")
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--split", default="test")
    p.add_argument("--text_column", default="text")
    p.add_argument("--limit", type=int, default=None, help="score the first N texts only")
    p.add_argument("--block_size", type=int, default=None,
                   help="built-in: longest block (default: the model's max; with --extend any length, 0 = whole texts)")
    p.add_argument("--extend", action="store_true",
                   help='read past max_position_embeddings (sets config.position_overflow="extend" for this run)')
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--no_metric", action="store_true", help="skip the evaluate metric")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_cli(parse_args, run, argv, CLI_ERRORS)


def run(args) -> int:
    out = score(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


def score(args) -> dict:
    """Both perplexities of the texts, printed; the --json record."""
    model, tokenizer = load_saved(args.model, args.extend)
    texts = read_texts(args)
    extends = reads_past_range(model)
    max_positions = None if extends else model.config.max_position_embeddings  # extends: the metric reads whole texts
    built_in = perplexity(model, tokenizer, texts, block_size=args.block_size, batch_size=args.batch_size)
    out = {"texts": len(texts), "built_in": asdict(built_in)}
    print(f"built-in perplexity: {built_in.perplexity:.4f} over {built_in.num_tokens} predicted tokens "
          f"({built_in.num_blocks} blocks of at most {built_in.block_size} tokens)")
    if args.no_metric:
        return out
    # the Hub metric loads the saved model itself, without this run's --extend: run its steps here instead
    in_process = extends and getattr(AutoConfig.from_pretrained(args.model), "position_overflow", "error") != "extend"
    if in_process:
        print("note: --extend is set for this run only; the metric's steps run in-process (the Hub metric "
              "would load the saved model, which stops at its max_position_embeddings).", file=sys.stderr)
    result, source = metric_perplexity(args.model, texts, args.batch_size, max_positions, model, tokenizer, in_process)
    out["metric"] = {"source": source, **result}
    print(f"metric mean_perplexity ({source}): {result['mean_perplexity']:.4f} "
          f"(mean of {len(result['perplexities'])} per-text perplexities, "
          + (f"texts cut to {max_positions} tokens)" if max_positions else "whole texts)"))
    return out
