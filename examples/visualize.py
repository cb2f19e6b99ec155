"""Draw the energy path of a text through a saved BriLLM's graph, dump its energy trace, or write an interactive page.

    python examples/visualize.py --model outputs/demo --text "the cat sat on the mat" --output path.png
    python examples/visualize.py --model outputs/demo --text "the cat" --output path.svg --top_k 4 --json trace.json
    python examples/visualize.py --model outputs/demo --text "the cat" --html path.html --generate 20 --node " cat"
    python examples/visualize.py --model outputs/demo --compare outputs/finetuned --text "the cat" --html diff.html

For every position t of the text: the node the signal sits on (token t), the true next node (token t+1), the energy
its edge delivers, its rank among all V nodes (1 = strongest), and the strongest other nodes with their energies.
The picture's format follows the --output extension (.png, .svg, .pdf); it needs matplotlib. --html writes one
self-contained page (no server, no network; modeling_brillm/explorer): the text as prose and its steps with their
alternatives and the signal's mix, the continuation of --generate new tokens, every visited node's edges, and with
--compare the same text through a second model, step by step (docs/explorer.md).

The model is read by this package's BriLLM; a folder's own code runs only with --trust_remote_code.
"""

from __future__ import annotations

import argparse
import json
import sys

EXTEND_FIX = ": pass --extend to read past them."
TRUST_FIX = ("BriLLM's package is not installed here and {name!r} holds its own model code: install the package "
             "(pip install -e .), or pass --trust_remote_code if you trust that code.")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="saved model folder or Hub id")
    p.add_argument("--text", required=True, help="the text to trace (the tokenizer's BOS is prepended)")
    p.add_argument("--output", default=None, help="image file: .png, .svg or .pdf")
    p.add_argument("--html", default=None, help="write the interactive page (one self-contained HTML file) here")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="with --html: also continue the text by N tokens (greedy energy_generate) in the page")
    p.add_argument("--node", action="append", default=[], metavar="TOKEN_OR_ID",
                   help="with --html: add this node's edges to the page's Node view: a token's text, or its id in "
                        "digits (a token spelt in digits is given by its id); repeatable")
    p.add_argument("--compare", default=None, metavar="MODEL",
                   help="with --html: a second saved model (folder or Hub id, the same tokenizer): the page "
                        "compares the text's path through both, step by step")
    p.add_argument("--top_k", type=int, default=3, help="alternatives drawn per step (default 3; the page shows 5+)")
    p.add_argument("--max_steps", type=int, default=80, help="draw at most this many steps")
    p.add_argument("--json", default=None, help="also write the per-step trace records to this JSON file")
    p.add_argument("--extend", action="store_true",
                   help='trace texts past max_position_embeddings (sets config.position_overflow="extend")')
    p.add_argument("--trust_remote_code", action="store_true",
                   help="without this package installed: let the saved folder's own code load the model")
    return p.parse_args(argv)


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
    if args.text == "":
        return "the text is empty: give --text some words to trace"
    return None


def quiet_libraries():
    """No library warnings, retry notices or progress bars on a normal run (the script checks lengths itself and
    says what failed in one line); errors still show."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()


def load(name: str, extend: bool, trust_remote_code: bool):
    """(model, tokenizer, energy_trace, plot_energy_path): this package's when it is installed; else, only with
    --trust_remote_code, the folder's own code."""
    try:
        from modeling_brillm import energy_trace, plot_energy_path
        from modeling_brillm.explorer import load_model
    except ImportError:
        return load_without_package(name, extend, trust_remote_code)
    return (*load_model(name, extend), energy_trace, plot_energy_path)


def check_text(model, text, tokenizer) -> None:
    """An empty text, a single token or a text past the trained positions, said before anything is written."""
    try:
        from modeling_brillm.explorer import check_text
    except ImportError:  # the folder's own code: energy_trace's message, with the fix this command line has
        if len(tokenizer(text)["input_ids"]) > model.config.max_position_embeddings and (
                getattr(model.config, "position_overflow", "error") != "extend"):
            raise ValueError("the text holds more tokens than the positions this model was trained on"
                             + EXTEND_FIX) from None
        return
    check_text(model, text, tokenizer)


def load_without_package(name: str, extend: bool, trust_remote_code: bool):
    import importlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=trust_remote_code).eval()
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise ValueError(TRUST_FIX.format(name=name)) from None
        raise
    if extend:
        model.config.position_overflow = "extend"
    interp = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".interpretability")
    return model, tokenizer, interp.energy_trace, interp.plot_energy_path


def node_ids(nodes: list[str]) -> list:
    """--node values: digits are an id, anything else a token's text."""
    return [int(n) if n.strip().isdigit() else n for n in nodes]


def write_page(args, model, tokenizer):
    from modeling_brillm.explorer import compare, explore, load_model

    if args.compare:
        other, other_tokenizer = load_model(args.compare, args.extend)
        page = compare(model, other, args.text, tokenizer, other_tokenizer, top_k=max(args.top_k, 5))
    else:
        page = explore(model, args.text, tokenizer, prompt=args.text if args.generate > 0 else None,
                       max_new_tokens=args.generate, top_k=max(args.top_k, 5), nodes=node_ids(args.node))
    page.save(args.html)
    return page


def run(args) -> None:
    if args.html:  # before anything is written: the explorer is the installed package's, never a folder's code
        try:
            import modeling_brillm.explorer  # noqa: F401
        except ImportError:
            raise ValueError("--html needs BriLLM's package installed (pip install -e .): a saved folder holds the "
                             "model's code, not the explorer's.") from None
    model, tokenizer, energy_trace, plot_energy_path = load(args.model, args.extend, args.trust_remote_code)
    check_text(model, args.text, tokenizer)
    if args.html:
        page = write_page(args, model, tokenizer)
    trace = energy_trace(model, args.text, tokenizer, top_k=max(args.top_k, 5))
    if args.output:
        plot_energy_path(trace, args.output, top_k=args.top_k, max_steps=args.max_steps)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"text": args.text, "summary": trace.summary(), "steps": trace.to_records()}, f, indent=1)
    report(trace, [f for f in (args.output, args.html, args.json) if f])
    if args.html and args.compare:
        report_diff(page.data)


def main(argv=None) -> int:
    args = parse(argv)
    problem = check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    quiet_libraries()
    try:
        run(args)
    except (ValueError, TypeError, OSError, ImportError) as error:
        problem = getattr(error, "problem", None)  # a text past the trained positions: the fix is a flag here
        message = problem + EXTEND_FIX if problem else (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


def report(trace, written):
    summary = trace.summary()
    print(f"{summary['steps']} steps, perplexity {summary['perplexity']:.3f}, "
          f"top-1 {summary['top1_accuracy']:.1%}, mean rank {summary['mean_rank']:.2f}; wrote {', '.join(written)}")
    for step in trace.steps():
        marker = ("" if step.rank == 1 else
                  f"   (model prefers {step.predicted_text!r}: {step.predicted_energy:.2f})")
        print(f"  {step.position:3d} {step.source_text!r:>10} -> {step.target_text!r:<10} "
              f"energy {step.energy:8.3f} rank {step.rank}{'' if step.real_edge else ' [shared edge]'}{marker}")


def report_diff(data):
    (a, b), names = data["paths"], data["diff"]["names"]
    for path, name in ((a, names[0]), (b, names[1])):
        s = path["summary"]
        print(f"{name}: perplexity {s['perplexity']:.3f}, top-1 {s['top1_accuracy']:.1%}, mean rank "
              f"{s['mean_rank']:.2f}")
    for i in data["diff"]["changed"]:
        print(f"  step {i:3d}: rank {a['steps'][i]['rank']} -> {b['steps'][i]['rank']}")


if __name__ == "__main__":
    sys.exit(main())
