"""A Gradio app around BriLLM's explorer: pick one of the models it was started with, type a prompt, generate, and
see the energy path of the prompt, its continuation and every visited node (the page `visualize.py --html` writes).

    pip install -e ".[app]"
    python examples/app.py --model outputs/demo                           # then open http://127.0.0.1:7860
    python examples/app.py --model outputs/demo outputs/finetuned         # a list: the page offers each
    python examples/app.py --model outputs/demo --allow_any_model         # also any folder or Hub id typed in

Runs on the CPU and binds to 127.0.0.1 only. With --allow_any_model its messages do not say whether a path typed
in exists on the server. Loaded models stay in a small cache (modeling_brillm/explorer/app.py)."""

import sys

if __name__ == "__main__":
    try:
        from modeling_brillm.explorer.app import main
    except ModuleNotFoundError as missing:  # the package is what reads the model: a saved folder's code cannot
        if not (missing.name or "").startswith("modeling_brillm"):
            raise
        print('error: app.py needs BriLLM\'s package: pip install -e ".[app]" in the repository', file=sys.stderr)
        sys.exit(2)
    sys.exit(main(description=__doc__))
