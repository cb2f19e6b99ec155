"""The explorer's screenshots in docs/img, rewritten from a saved model (make demo's) in headless chromium.

    python tests/explorer/screenshots.py --model outputs/demo --out docs/img

One picture per view: the Text view (a step pinned), the Generation view, the Node view of " object", the Text view
of a Chinese text (the byte-level tokens grouped into characters; the machine needs a CJK font, such as Debian's
fonts-wqy-zenhei, or the characters draw as boxes), and the Diff view of the model against a copy tuned for a few
steps on one paragraph (the tuning runs here, seeded, on the CPU). The commands that write the same pages are in
docs/explorer.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _browser import start_browser  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402

from modeling_brillm.explorer import compare, explore, load_model  # noqa: E402

TEXT = "A class definition is an executable statement. The module"
CHINESE = "\u4e2d\u6587\u7684\u6587\u672c\uff1a\u4f60\u597d\uff0c\u4e16\u754c\u3002The module"
TUNE = ("A module is a file containing Python definitions and statements. The file name is the module name with "
        "the suffix .py appended. Within a module, the module's name is available as the value of the global "
        "variable __name__.")
PROBE = "A module is a file containing Python definitions and statements."


def tuned(model, tokenizer, steps: int = 12, seed: int = 0):
    """A copy of `model` trained `steps` Adam steps on TUNE: the "after" of the diff picture."""
    torch.manual_seed(seed)
    other = copy.deepcopy(model).train()
    ids = torch.tensor([tokenizer(TUNE)["input_ids"]])
    optimizer = torch.optim.Adam(other.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = other(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return other.eval()


def shoot(browser, page, out: Path, view: str | None = None, step: int | None = None, height: int = 760):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "page.html"
        page.save(path)
        browser.set_window_size(1280, height)
        browser.get(path.as_uri())
        time.sleep(0.3)
        if view:
            browser.find_element("id", f"tab-{view}").click()
        if step is not None:
            browser.find_element("css selector", f'#view-{view or "trace"} .strip .step[data-step="{step}"]').click()
            ActionChains(browser).move_to_element(browser.find_element("tag name", "h1")).perform()  # no hover mark
        time.sleep(0.2)
        browser.save_screenshot(str(out))
    print("wrote", out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="outputs/demo", help="the saved model to draw (default: make demo's)")
    p.add_argument("--out", default="docs/img", help="the folder the pictures go to")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model)
    page = explore(model, TEXT, tokenizer, prompt=TEXT, max_new_tokens=30, nodes=[" object"])
    chinese = explore(model, CHINESE, tokenizer)
    diff = compare(model, tuned(model, tokenizer), PROBE, tokenizer, names=["demo", "demo, tuned 12 steps"])
    browser = start_browser(1280, 760)
    try:
        shoot(browser, page, out / "explorer-text.png", step=13)
        shoot(browser, page, out / "explorer-generation.png", view="generation")
        shoot(browser, page, out / "explorer-node.png", view="node", height=820)
        shoot(browser, chinese, out / "explorer-chinese.png", step=2)
        shoot(browser, diff, out / "explorer-diff.png", height=820)
    finally:
        browser.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
