"""examples/app.py: a Gradio app that serves the explorer's page of a prompt and its continuation, on 127.0.0.1 only,
for the models of its command line (any folder or Hub id only with --allow_any_model)."""

import argparse
import os
import sys
import threading
from collections import OrderedDict

import torch

from .build import Explorer, explore, folder_problem, load_model, one_line, quiet

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a local tool, set before Gradio loads
EXTEND_FIX = ": tick \u201cread past the trained positions\u201d to read past them."
HEIGHT = 760
NOT_LISTED = "this app opens only the models it was started with: pick one from the list."
CANNOT_OPEN = "cannot open {name!r} as a BriLLM model (a saved model folder this server can read, or a Hub id)."


def resolve(name: str) -> str:
    """The cache's key: a folder's real path (every spelling of it one model), else the name (a Hub id)."""
    name = os.path.expanduser(str(name or "").strip())
    return os.path.realpath(name) if name and os.path.isdir(name) else name


class Models:
    """The models served (`listed`, or any with `allow_any`), loaded on first use into an LRU cache of `size`."""

    def __init__(self, listed=(), allow_any: bool = False, size: int = 2):
        self.listed = {resolve(n) for n in listed}
        self.allow_any, self.size = bool(allow_any), max(1, int(size))
        self.loaded: OrderedDict = OrderedDict()
        self.lock = threading.Lock()  # one request at a time: each sets the position overflow it asks for

    def get(self, name: str):
        """(model, tokenizer, its own overflow), or a one-line ValueError that tells nothing of the server's files."""
        if (key := resolve(name)) in self.loaded:
            self.loaded.move_to_end(key)
            return self.loaded[key]
        if key not in self.listed and not self.allow_any:
            raise ValueError(NOT_LISTED)
        try:
            model, tokenizer = load_model(key)
        except Exception:  # any failure reads the same, so the message tells nothing of the server's files
            if key in self.listed:
                raise
            raise ValueError(CANNOT_OPEN.format(name=str(name).strip())) from None
        self.loaded[key] = (model, tokenizer, model.config.position_overflow)
        while len(self.loaded) > self.size:
            self.loaded.popitem(last=False)
        return self.loaded[key]


def explore_prompt(models: Models, name, prompt, new_tokens, sample, temperature, seed, extend):
    """(the page in an iframe, a one-line status): the prompt's trace and its continuation, or the error's page."""
    try:
        if not (prompt or "").strip():
            raise ValueError("the prompt is empty: type a few words to trace and continue.")
        options = {"do_sample": bool(sample)}
        if sample:
            options.update(temperature=float(temperature), generator=torch.Generator().manual_seed(int(seed)))
        with models.lock:
            model, tokenizer, overflow = models.get(name or "")
            model.config.position_overflow = "extend" if extend else overflow
            try:
                page = explore(model, prompt, tokenizer, prompt=prompt, max_new_tokens=int(new_tokens), **options)
            finally:
                model.config.position_overflow = overflow
    except (ValueError, TypeError, OSError, ImportError) as error:
        message = one_line(error, EXTEND_FIX)
        return Explorer.error(message).iframe(HEIGHT), f"error: {message}"
    trace, generated = page.data["paths"]
    s = trace["summary"]
    return page.iframe(HEIGHT), (f"{len(trace['steps'])} steps traced (perplexity {s['perplexity']:.3f}, top-1 "
                                 f"{s['top1_accuracy']:.0%}), {len(generated['steps'])} tokens generated")


def build(models=(), extend: bool = False, allow_any: bool = False):
    """The app's Blocks (not launched) serving `models` (a list of folders or Hub ids): `serve(build(...))` runs it."""
    import gradio as gr

    listed = [models] if isinstance(models, str) else list(models)
    served = Models(listed, allow_any)
    with gr.Blocks(title="BriLLM explorer") as app:
        gr.Markdown("## BriLLM explorer\nThe energy path of a prompt through a BriLLM graph and of the continuation "
                    "BriLLM's own decoding writes after it: hover or click a step, follow a node to its edges.")
        with gr.Row():
            name = gr.Dropdown(choices=listed, value=listed[0] if listed else None, allow_custom_value=allow_any,
                               label="model" + (" (one of the list, or a folder or Hub id)" if allow_any else ""),
                               elem_id="model", scale=3)
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
        gr.on([run.click, prompt.submit], lambda *values: explore_prompt(served, *values), inputs, [view, status])
    return app


def serve(app, port: int | None = None, block: bool = True):
    """Launch on 127.0.0.1 only (`port` None: Gradio's default or the first free one after it)."""
    return app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=not block, ssr_mode=False,
                      quiet=not block, footer_links=[])


def check_listed(names: list[str], allow_any: bool) -> str | None:
    """The command line's mistakes, said before the server starts: no model, a listed folder that cannot be one."""
    if not names and not allow_any:
        return "give --model FOLDER_OR_HUB_ID (one or more): the app opens only the models it is started with"
    return next((p for name in names if (p := folder_problem(os.path.expanduser(name.strip())))), None)


def main(argv=None, description=None) -> int:
    """Serve the app of the command line `argv` until stopped; 2 after one `error:` line (`description`: --help)."""
    p = argparse.ArgumentParser(description=description or __doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", action="extend", default=[], metavar="MODEL",
                   help="the saved model folders or Hub ids the app offers (one or more; repeatable)")
    p.add_argument("--allow_any_model", action="store_true",
                   help="also open any folder of this server or Hub id typed into the page (off: only --model's)")
    p.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: Gradio's, 7860)")
    p.add_argument("--extend", action="store_true", help="read and generate past the trained positions")
    args = p.parse_args(argv)
    try:
        import gradio  # noqa: F401
        problem = check_listed(args.model, args.allow_any_model)
    except ImportError:
        problem = 'the app needs Gradio: pip install -e ".[app]"'
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with quiet():  # the app says what failed in its status line; no library warnings or progress bars
        serve(build(args.model, args.extend, args.allow_any_model), args.port)
    return 0
