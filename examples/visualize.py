"""Draw the energy path of a text through a saved BriLLM's graph, dump its energy trace, or write an interactive page.

    python examples/visualize.py --model outputs/demo --text "the cat sat on the mat" --output path.png
    python examples/visualize.py --model outputs/demo --text "the cat" --output path.svg --top_k 4 --json trace.json
    python examples/visualize.py --model outputs/demo --text "the cat" --html path.html --generate 20 --node " cat"
    python examples/visualize.py --model outputs/demo --compare outputs/finetuned --text "the cat" --html diff.html

Every step of the path: the node the signal sits on, the true next node, the energy its edge delivers, its rank
among all V nodes (1 = strongest) and the strongest others. --output's extension picks the format (.png, .svg, .pdf;
needs matplotlib); --html writes one self-contained page (docs/explorer.md). The installed package's BriLLM reads
the model, never a saved folder's own code (modeling_brillm/explorer/cli.py)."""

import sys

if __name__ == "__main__":
    try:
        from modeling_brillm.explorer.cli import main
    except ModuleNotFoundError as missing:  # the package is what reads the model: a saved folder's code cannot
        if not (missing.name or "").startswith("modeling_brillm"):
            raise
        print("error: visualize.py needs BriLLM's package: pip install -e . in the repository", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(description=__doc__))
