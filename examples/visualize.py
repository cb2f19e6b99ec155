"""Draw the energy path of a text through a saved BriLLM's graph, dump its energy trace, or write an interactive page.

    python examples/visualize.py --model outputs/demo --text "the cat sat on the mat" --output path.png
    python examples/visualize.py --model outputs/demo --text "the cat" --output path.svg --top_k 4 --json trace.json
    python examples/visualize.py --model outputs/demo --text "the cat" --html path.html --generate 20

For every position t of the text: the node the signal sits on (token t), the true next node (token t+1), the energy
its edge delivers, its rank among all V nodes (1 = strongest), and the strongest other nodes with their energies.
The picture's format follows the --output extension (.png, .svg, .pdf); it needs matplotlib. --html writes one
self-contained page (no server, no network; modeling_brillm/explorer.py): the steps with their alternatives and the
signal's mix, the continuation of --generate new tokens, and every visited node's strongest edges (docs/explorer.md).
"""

from __future__ import annotations

import argparse
import json
import sys

EXTEND_HINT = "; pass --extend to read past the trained positions"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="saved model folder or Hub id")
    p.add_argument("--text", required=True, help="the text to trace (the tokenizer's BOS is prepended)")
    p.add_argument("--output", default=None, help="image file: .png, .svg or .pdf")
    p.add_argument("--html", default=None, help="write the interactive page (one self-contained HTML file) here")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="with --html: also continue the text by N tokens (greedy energy_generate) in the page")
    p.add_argument("--node", action="append", default=[], metavar="TOKEN",
                   help="with --html: add this token's neighbourhood to the page's Node view (repeatable)")
    p.add_argument("--top_k", type=int, default=3, help="alternatives drawn per step (default 3; the page shows 5+)")
    p.add_argument("--max_steps", type=int, default=80, help="draw at most this many steps")
    p.add_argument("--json", default=None, help="also write the per-step trace records to this JSON file")
    p.add_argument("--extend", action="store_true",
                   help='trace texts past max_position_embeddings (sets config.position_overflow="extend")')
    args = p.parse_args(argv)
    if args.output is None and args.html is None and args.json is None:
        p.error("nothing to write: give --output (a picture), --html (the interactive page) or --json")
    try:
        model, tokenizer, interp = load(args.model, args.extend)
        trace = interp.energy_trace(model, args.text, tokenizer, top_k=max(args.top_k, 5))
        if args.output:
            interp.plot_energy_path(trace, args.output, top_k=args.top_k, max_steps=args.max_steps)
        if args.html:
            from modeling_brillm.explorer import explore

            page = explore(model, args.text, tokenizer, prompt=args.text if args.generate > 0 else None,
                           max_new_tokens=args.generate, top_k=max(args.top_k, 5), nodes=args.node,
                           title=f"BriLLM explorer: {args.model}")
            page.save(args.html)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"text": args.text, "summary": trace.summary(), "steps": trace.to_records()}, f, indent=1)
        report(trace, [f for f in (args.output, args.html, args.json) if f])
    except (ValueError, TypeError, OSError, ImportError) as error:
        message = str(error)
        hint = EXTEND_HINT if "max_position_embeddings" in message and not args.extend else ""
        print(f"error: {message}{hint}", file=sys.stderr)
        return 2
    return 0


def load(name: str, extend: bool):
    """(model, tokenizer, the interpretability module): this package's when it is installed, else the folder's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from modeling_brillm import interpretability
        from modeling_brillm.explorer import load_model
    except ImportError:
        interpretability = None
    if interpretability is not None:
        return (*load_model(name, extend), interpretability)
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True).eval()
    if extend:
        model.config.position_overflow = "extend"
        tokenizer.model_max_length = int(1e30)  # the trained range would warn of indexing errors falsely
    import importlib

    return model, tokenizer, importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".interpretability")


def report(trace, written):
    summary = trace.summary()
    print(f"{summary['steps']} steps, perplexity {summary['perplexity']:.3f}, "
          f"top-1 {summary['top1_accuracy']:.1%}, mean rank {summary['mean_rank']:.2f}; wrote {', '.join(written)}")
    for step in trace.steps():
        marker = ("" if step.rank == 1 else
                  f"   (model prefers {step.predicted_text!r}: {step.predicted_energy:.2f})")
        print(f"  {step.position:3d} {step.source_text!r:>10} -> {step.target_text!r:<10} "
              f"energy {step.energy:8.3f} rank {step.rank}{'' if step.real_edge else ' [shared edge]'}{marker}")


if __name__ == "__main__":
    sys.exit(main())
