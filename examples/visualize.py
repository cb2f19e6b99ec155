"""Draw the energy path of a text through a saved BriLLM's graph, and dump its energy trace.

    python examples/visualize.py --model outputs/demo --text "the cat sat on the mat" --output path.png
    python examples/visualize.py --model outputs/demo --text "the cat" --output path.svg --top_k 4 --json trace.json

For every position t of the text: the node the signal sits on (token t), the true next node (token t+1), the energy
its edge delivers, its rank among all V nodes (1 = strongest), and the strongest other nodes with their energies.
The picture's format follows the --output extension (.png, .svg, .pdf). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="saved model folder or Hub id")
    p.add_argument("--text", required=True, help="the text to trace (the tokenizer's BOS is prepended)")
    p.add_argument("--output", required=True, help="image file: .png, .svg or .pdf")
    p.add_argument("--top_k", type=int, default=3, help="alternatives drawn per step (default 3)")
    p.add_argument("--max_steps", type=int, default=80, help="draw at most this many steps")
    p.add_argument("--json", default=None, help="also write the per-step trace records to this JSON file")
    p.add_argument("--extend", action="store_true",
                   help='trace texts past max_position_embeddings (sets config.position_overflow="extend")')
    args = p.parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            import modeling_brillm  # noqa: F401
            from modeling_brillm.interpretability import energy_trace, plot_energy_path
            remote = False
        except ImportError:
            remote = True
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=remote)
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=remote).eval()
        if args.extend:
            model.config.position_overflow = "extend"
            tokenizer.model_max_length = int(1e30)  # the trained range would warn of indexing errors falsely
        if remote:
            import importlib

            module = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".interpretability")
            energy_trace, plot_energy_path = module.energy_trace, module.plot_energy_path
        trace = energy_trace(model, args.text, tokenizer, top_k=max(args.top_k, 5))
        plot_energy_path(trace, args.output, top_k=args.top_k, max_steps=args.max_steps)
        summary = trace.summary()
        print(f"{summary['steps']} steps, perplexity {summary['perplexity']:.3f}, "
              f"top-1 {summary['top1_accuracy']:.1%}, mean rank {summary['mean_rank']:.2f}; wrote {args.output}")
        for step in trace.steps():
            marker = ("" if step.rank == 1 else
                      f"   (model prefers {step.predicted_text!r}: {step.predicted_energy:.2f})")
            print(f"  {step.position:3d} {step.source_text!r:>10} -> {step.target_text!r:<10} "
                  f"energy {step.energy:8.3f} rank {step.rank}{'' if step.real_edge else ' [shared edge]'}{marker}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"text": args.text, "summary": summary, "steps": trace.to_records()}, f, indent=1)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
