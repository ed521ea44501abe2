"""Screenshots of the app for the README, on the real default backbone and the shipped capsules.

    python tests/screenshots.py docs/screenshots

Not a test (pytest does not collect it): it starts `python app.py` (SmolLM2-135M, offline) on a free port and
drives Debian's chromium through Playwright as tests/test_browser.py does (same flags, helpers imported from
there): Predict with the shipped CB capsule on CB val example 37, Attention with the shipped CB soft prompt
beside the capsule and the sink, the training-free probe, and the Train tab a few steps into a run (then Stop).
"""
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from conftest import free_port  # noqa: E402
from test_browser import CHROMIUM, FLAGS, ROOT, block, chart, field, panel, shows  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from capt.io import find_soft_prompts  # noqa: E402

SLOW = 300_000   # ms: SmolLM2 on a busy 2-core CPU
EXAMPLE = 37     # the CB val example the README's pictures and text are about


def pick(page, label: str, option: str) -> None:
    """Choose `option` in the visible dropdown labelled `label`."""
    field(page, label).click()
    page.get_by_role("option", name=option, exact=True).click()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log = open(Path(tempfile.gettempdir()) / "capt-screenshots-server.log", "w")   # not into the repo
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(SLOW)
            page.errors = []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            page.goto(url)

            pick(page, "Capsule", "shipped: cb")
            expect(field(page, "Task")).to_have_value("cb")
            # The button draws a val example at random; draw until the README's one (idx 37) comes up, so that a
            # retake shows the input the README's text describes (CB val has 56 examples).
            note, shown = page.get_by_text(re.compile(r"cb val example idx \d+ ")), ""
            for _ in range(500):
                page.get_by_role("button", name="Example from val").click()
                try:   # wait for this draw to land (a draw of the same example changes nothing: 5 s, then go on)
                    expect(note).not_to_have_text(shown, timeout=5000) if shown else expect(note).to_be_visible()
                except AssertionError:
                    pass
                shown = note.inner_text()
                if shown.startswith(f"cb val example idx {EXAMPLE} "):
                    break
            else:
                raise RuntimeError(f"'Example from val' never drew cb val example {EXAMPLE}")
            page.get_by_role("button", name="Predict", exact=True).click()
            shows(page, chart(panel(page), "label probabilities with and without the capsule"), SLOW)
            page.screenshot(path=str(out / "predict.png"), full_page=True)

            page.get_by_role("tab", name="Attention", exact=True).click()
            soft = [f"shipped: {f.parent.name}/{f.name}" for f in find_soft_prompts(ROOT / "capsules", "smollm2-135m")
                    if f.name == "cb"]
            if soft:
                pick(page, "compare with a soft prompt", soft[0])
            page.get_by_role("button", name="Show attention", exact=True).click()
            shows(page, chart(panel(page), "with the soft prompt" if soft else "with the capsule"), SLOW)
            page.screenshot(path=str(out / "attention.png"), full_page=True)
            page.get_by_text("Training-free probe", exact=False).click()
            page.get_by_role("button", name="Run the probe").click()
            shows(page, chart(panel(page), "accuracy per k"), SLOW)
            block(panel(page), "accuracy per k").evaluate("e => e.scrollIntoView({block: 'center'})")
            page.screenshot(path=str(out / "probe.png"))

            page.get_by_role("tab", name="Train", exact=True).click()
            view = panel(page)
            view.get_by_role("radio", name="quick: 20 steps").check()
            view.get_by_role("button", name="Train", exact=True).click()
            shows(page, view.get_by_text(re.compile(r"^step \d+/\d+ · loss .* best dev")), SLOW)   # after a dev eval
            page.screenshot(path=str(out / "train.png"), full_page=True)
            view.get_by_role("button", name="Stop", exact=True).click()
            shows(page, view.get_by_text(re.compile(r"^Done \(stop requested\)")), SLOW)
            assert page.errors == [], page.errors
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"wrote {', '.join(sorted(p.name for p in out.glob('*.png')))} to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots"))
