"""examples/visualize.py: a text's energy path as a picture (--output), its trace records (--json) and the explorer's
page (--html, with --generate, --node and --compare); every mistake one `error:` line and status 2."""

import argparse
import json
import sys

from .. import energy_trace, plot_energy_path
from .build import check_text, compare, explore, load_model, one_line, quiet


def check(args) -> str | None:
    """The command line's own mistakes, found before anything is loaded."""
    if args.output is None and args.html is None and args.json is None:
        return "nothing to write: give --output (a picture), --html (the interactive page) or --json"
    if args.generate < 0:
        return f"--generate takes a number of new tokens, 0 or more (got {args.generate})"
    for flag, given in (("--generate", args.generate > 0), ("--node", args.node), ("--compare", args.compare)):
        if given and args.html is None:
            return f"{flag} adds to the interactive page: give --html PAGE.html too"
    if args.top_k < 1 or args.max_steps < 1:
        return "--top_k and --max_steps take a number, 1 or more"
    return "the text is empty: give --text some words to trace" if args.text == "" else None


def run(args) -> None:
    """Load, write what was asked for, and print the path's summary and steps (and a diff's changed steps)."""
    model, tokenizer = load_model(args.model, args.extend)
    check_text(model, args.text, tokenizer)
    top_k = max(args.top_k, 5)
    if args.compare:
        other, other_tokenizer = load_model(args.compare, args.extend)
        page = compare(model, other, args.text, tokenizer, other_tokenizer, top_k=top_k)
    elif args.html:  # --node values: digits are an id, anything else a token's text
        nodes = [int(n) if n.strip().isdigit() else n for n in args.node]
        page = explore(model, args.text, tokenizer, prompt=args.text if args.generate > 0 else None,
                       max_new_tokens=args.generate, top_k=top_k, nodes=nodes)
    if args.html:
        page.save(args.html)
    trace = energy_trace(model, args.text, tokenizer, top_k=top_k)
    if args.output:
        plot_energy_path(trace, args.output, top_k=args.top_k, max_steps=args.max_steps)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"text": args.text, "summary": trace.summary(), "steps": trace.to_records()}, f, indent=1)
    summary, written = trace.summary(), ", ".join(f for f in (args.output, args.html, args.json) if f)
    print(f"{summary['steps']} steps, perplexity {summary['perplexity']:.3f}, "
          f"top-1 {summary['top1_accuracy']:.1%}, mean rank {summary['mean_rank']:.2f}; wrote {written}")
    for step in trace.steps():
        marker = "" if step.rank == 1 else f"   (model prefers {step.predicted_text!r}: {step.predicted_energy:.2f})"
        print(f"  {step.position:3d} {step.source_text!r:>10} -> {step.target_text!r:<10} "
              f"energy {step.energy:8.3f} rank {step.rank}{'' if step.real_edge else ' [shared edge]'}{marker}")
    if args.compare:
        a, b = page.data["paths"]
        for path in (a, b):
            s = path["summary"]
            print(f"{path['name']}: perplexity {s['perplexity']:.3f}, top-1 {s['top1_accuracy']:.1%}, mean rank "
                  f"{s['mean_rank']:.2f}")
        for i in page.data["diff"]["changed"]:
            print(f"  step {i:3d}: rank {a['steps'][i]['rank']} -> {b['steps'][i]['rank']}")


def main(argv=None, description=None) -> int:
    """Run the command line `argv`: 0, or 2 after one `error:` line on stderr (`description`: the --help text)."""
    p = argparse.ArgumentParser(description=description or __doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="saved model folder or Hub id")
    p.add_argument("--text", required=True, help="the text to trace (the tokenizer's BOS is prepended)")
    p.add_argument("--output", default=None, help="image file: .png, .svg or .pdf")
    p.add_argument("--html", default=None, help="write the interactive page (one self-contained HTML file) here")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="with --html: continue the text by N tokens")
    p.add_argument("--node", action="append", default=[], metavar="TOKEN_OR_ID", help="with --html: add this "
                   "node's edges to the Node view: a token's text, or its id in digits (repeatable)")
    p.add_argument("--compare", default=None, metavar="MODEL", help="with --html: a second saved model (the same "
                   "tokenizer): the page compares the text's path through both, step by step")
    p.add_argument("--top_k", type=int, default=3, help="alternatives drawn per step (default 3; the page shows 5+)")
    p.add_argument("--max_steps", type=int, default=80, help="draw at most this many steps")
    p.add_argument("--json", default=None, help="also write the per-step trace records to this JSON file")
    p.add_argument("--extend", action="store_true", help="trace texts past the positions the model was trained on")
    args = p.parse_args(argv)
    try:
        if problem := check(args):
            raise ValueError(problem)
        with quiet():  # no library warnings or progress bars: the lengths are checked here and said in one line
            run(args)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"error: {one_line(error, ': pass --extend to read past them.')}", file=sys.stderr)
        return 2
    return 0
