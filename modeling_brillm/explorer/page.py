"""The explorer's page: its data as JSON inside one self-contained HTML file with its script and style (no server,
no network), and the sandboxed iframe that notebooks and the Gradio app show."""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

_STATIC = Path(__file__).resolve().parent / "static"
# the page's script in the order it runs: helpers, the energy chart, the path, Node and diff views, the start
SCRIPTS = ("base.js", "chart.js", "path.js", "node.js", "diff.js", "main.js")


@dataclass
class Explorer:
    """The page's data (`data`, JSON-ready) and its renderings: `to_html()`, `save(path)`, `_repr_html_()`."""

    data: dict = field(default_factory=dict)
    height: int = 720  # the notebook iframe's height in pixels

    @classmethod
    def error(cls, message: str, title: str = "BriLLM explorer") -> Explorer:
        """A page that shows `message` in place of the views (bad input, a model that would not load, ...)."""
        return cls({"title": title, "error": str(message)})

    def to_html(self) -> str:
        payload = json.dumps(self.data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        style = (_STATIC / "explorer.css").read_text(encoding="utf-8")
        script = "\n".join((_STATIC / name).read_text(encoding="utf-8") for name in SCRIPTS)
        title = html.escape(str(self.data.get("title", "BriLLM explorer")))
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
                f"<style>\n{style}</style></head>\n<body>\n<div id=\"app\"></div>\n"
                f'<script type="application/json" id="brillm-data">{payload}</script>\n'
                f'<script>\n(function () {{\n  "use strict";\n{script}\n}})();\n</script>\n</body></html>\n')

    def save(self, path) -> str:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_html(), encoding="utf-8")
        return os.fspath(path)

    def iframe(self, height: int | None = None) -> str:
        """The page inside a sandboxed iframe (scripts run, nothing else is allowed): for notebooks and Gradio."""
        return (f'<iframe class="brillm-explorer" sandbox="allow-scripts" style="width:100%;height:'
                f'{int(height or self.height)}px;border:1px solid #ddd;border-radius:6px" '
                f'srcdoc="{html.escape(self.to_html(), quote=True)}"></iframe>')

    def _repr_html_(self) -> str:
        return self.iframe()
