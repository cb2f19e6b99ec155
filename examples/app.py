"""A Gradio app around BriLLM's explorer: load a saved folder or Hub id, type a prompt, generate, and see the energy
path of the prompt, of the continuation and of every visited node live (the page `visualize.py --html` writes).

    pip install -e ".[app]"
    python examples/app.py --model outputs/demo        # then open http://127.0.0.1:7860

Runs on the CPU. The server binds to 127.0.0.1 only: the page is for this machine's browser, not the network.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a local tool

HOST = "127.0.0.1"
EXTEND_HINT = "; tick \u201cread past the trained positions\u201d to go on"
HEIGHT = 760


class Models:
    """The loaded models, by (name, extend): loading a model once per session, not once per click."""

    def __init__(self):
        self.loaded = {}

    def get(self, name: str, extend: bool):
        from modeling_brillm.explorer import load_model

        key = (name.strip(), bool(extend))
        if key not in self.loaded:
            self.loaded[key] = load_model(*key)
        return self.loaded[key]


def explore_prompt(models: Models, name, prompt, new_tokens, sample, temperature, seed, extend):
    """(the page in an iframe, a one-line status): the prompt's trace and its continuation, or the error's page."""
    import torch

    from modeling_brillm.explorer import Explorer, explore

    try:
        model, tokenizer = models.get(name or "", extend)
        options = {"do_sample": bool(sample)}
        if sample:
            options.update(temperature=float(temperature), generator=torch.Generator().manual_seed(int(seed)))
        page = explore(model, prompt, tokenizer, prompt=prompt, max_new_tokens=int(new_tokens),
                       title=f"BriLLM explorer: {name}", **options)
    except (ValueError, TypeError, OSError, ImportError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "max_position_embeddings" in message and not extend:
            message += EXTEND_HINT
        return Explorer.error(message).iframe(HEIGHT), f"error: {message}"
    trace, generated = page.data["paths"]
    summary = trace["summary"]
    status = (f"{len(trace['steps'])} steps traced (perplexity {summary['perplexity']:.3f}, top-1 "
              f"{summary['top1_accuracy']:.0%}), {len(generated['steps'])} tokens generated")
    return page.iframe(HEIGHT), status


def build(model: str = "", extend: bool = False):
    """The app's Blocks (not launched): `serve(build(...))` runs it."""
    import gradio as gr

    models = Models()
    with gr.Blocks(title="BriLLM explorer") as app:
        gr.Markdown("## BriLLM explorer\nThe energy path of a prompt through a BriLLM graph and of the continuation "
                    "BriLLM's own decoding writes after it: hover or click a step, follow a node to its strongest "
                    "edges.")
        with gr.Row():
            name = gr.Textbox(value=model, label="model (saved folder or Hub id)", elem_id="model", scale=3)
            extended = gr.Checkbox(value=extend, label="read past the trained positions", elem_id="extend")
        prompt = gr.Textbox(label="prompt", lines=2, elem_id="prompt", placeholder="the text to trace and continue")
        with gr.Row():
            new_tokens = gr.Slider(0, 200, value=20, step=1, label="new tokens", elem_id="new_tokens")
            sample = gr.Checkbox(value=False, label="sample (greedy when off)", elem_id="sample")
            temperature = gr.Slider(0.1, 2.0, value=1.0, step=0.05, label="temperature", elem_id="temperature")
            seed = gr.Number(value=0, precision=0, label="seed", elem_id="seed")
        run = gr.Button("Generate", variant="primary", elem_id="run")
        status = gr.Textbox(label="status", interactive=False, elem_id="status")
        view = gr.HTML(elem_id="view", js_on_load=None)
        inputs = [name, prompt, new_tokens, sample, temperature, seed, extended]
        handler = lambda *values: explore_prompt(models, *values)
        run.click(handler, inputs, [view, status])
        prompt.submit(handler, inputs, [view, status])
    app.models = models
    return app


def serve(app, port: int | None = None, block: bool = True):
    """Launch on 127.0.0.1 only (`port` None: Gradio's default or the first free one after it)."""
    return app.launch(server_name=HOST, server_port=port, prevent_thread_lock=not block, ssr_mode=False,
                      quiet=not block, footer_links=[])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="saved model folder or Hub id shown at start (editable in the app)")
    p.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: Gradio's, 7860)")
    p.add_argument("--extend", action="store_true", help="read and generate past the trained positions")
    args = p.parse_args(argv)
    try:
        import gradio  # noqa: F401
    except ImportError:
        print('error: the app needs Gradio: pip install -e ".[app]"', file=sys.stderr)
        return 2
    serve(build(args.model, args.extend), args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
