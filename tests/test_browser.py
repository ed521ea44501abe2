"""The app in a real browser: Playwright's Python package drives Debian's chromium (no browser download).

`python app.py` is launched in a subprocess on a free local port with the tiny random backbone (tiny-llama),
then one page goes through what a person does: it opens, predicts, shows the attention maps, starts and stops a
short training run, and trains on free text, checking what is on screen (texts, drawn plotly charts, no
warning/error toast).

Needs chromium (`apt-get install -y chromium`, at /usr/bin/chromium or on PATH; CAPT_CHROMIUM names another
binary) and the `playwright` package (requirements.txt); without either the module is skipped. The browser
runs headless with these flags:
  --headless=new                  Chrome's current headless mode (the same browser as on screen)
  --no-sandbox                    the sandbox needs user namespaces, unavailable as root or in most containers
  --disable-gpu                   no GPU here: software rendering (plotly's SVG/canvas draw the same)
  --disable-dev-shm-usage         small /dev/shm in containers: shared memory goes to /tmp instead
  --disable-background-networking no update, component or safe-browsing requests (offline machine)

CAPT_SCREENSHOTS=<folder> saves predict.png, attention.png and train.png there (full page, 1280 px wide).
"""
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from conftest import free_port

CHROMIUM = os.environ.get("CAPT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.isfile(CHROMIUM):
    pytest.skip(f"no chromium browser at {CHROMIUM} (install Debian's: apt-get install -y chromium)",
                allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="the playwright package is missing (pip install -r requirements.txt)")
from playwright.sync_api import expect, sync_playwright  # noqa: E402

expect.set_options(timeout=20_000)   # ms every assertion waits (Playwright's default: 5 s): a shared CPU redraws slowly

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking"]   # see the module docstring
SLOW = 120_000   # ms to wait for a result: a tiny model, but the CPU may be busy with other work
START_S = 240    # s for `python app.py` to import torch and gradio and serve the page


def log_tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python app.py` on a free port, tiny-llama by default, its files in a temporary folder; yields the URL."""
    tmp = tmp_path_factory.mktemp("browser")
    port = free_port()
    env = {**os.environ, "CAPT_APP_BACKBONE": "tiny-llama", "CAPT_APP_DIR": str(tmp / "sessions"),
           "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "GRADIO_TEMP_DIR": str(tmp / "gradio"),
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",          # one thread: fastest for a tiny model (conftest.py)
           "CAPT_APP_MAX_UPLOAD": "1mb"}   # small, so that the test below can go over it
    log = tmp / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}/", time.time() + START_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"python app.py exited with {proc.returncode}:\n{log_tail(log)}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"python app.py did not serve {url} within {START_S} s:\n{log_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(f"server log ({log}):\n{log_tail(log, 2000)}")   # shown by pytest for a failing test (-rA: always)


@pytest.fixture(scope="module")
def page(server):
    """One browser tab on the app, 1280 px wide, as one user session through all the tests; `page.errors`
    collects uncaught JavaScript errors."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        context.set_default_timeout(60_000)
        tab = context.new_page()
        tab.errors = []
        tab.on("pageerror", lambda e: tab.errors.append(str(e)))
        tab.goto(server, wait_until="domcontentloaded")
        try:
            yield tab
        finally:
            context.close()
            browser.close()


def screenshot(page, name: str) -> None:
    folder = os.environ.get("CAPT_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def block(scope, label: str):
    """The Gradio block (a plot, a file...) whose label, as shown above it, is exactly `label`."""
    assert '"' not in label
    return scope.locator(f'xpath=.//*[contains(concat(" ", normalize-space(@class), " "), " block ")]'
                         f'[label[@data-testid="block-label"][normalize-space(.)="{label}"]]')


def chart(scope, label: str):
    """The plotly chart drawn in the plot block labelled `label`."""
    return block(scope, label).locator(".js-plotly-plot")


def bad_toasts(page):
    return page.locator(".toast-body.error, .toast-body.warning")   # gr.Warning (the app's errors), gr.Error


def shows(page, target, timeout: int = SLOW) -> None:
    """Wait until `target` is visible, failing at once with its text if a warning or error toast comes first."""
    expect(target.or_(bad_toasts(page)).first).to_be_visible(timeout=timeout)
    no_trouble(page)
    expect(target).to_be_visible()


def no_trouble(page) -> None:
    toasts = bad_toasts(page)
    assert toasts.count() == 0, f"the page shows: {' | '.join(toasts.all_inner_texts())}"
    assert page.errors == [], f"JavaScript errors: {page.errors}"


def field(scope, label: str):
    """The input labelled `label` that is on screen (the Train tab has its own, hidden elsewhere, Backbone and Task)."""
    return scope.get_by_label(label, exact=True).filter(visible=True)


def fill_until_kept(box, value: str, tries: int = 10):
    """Type `value` into `box` and commit it (Tab) before anything reads the form, typing again while the page has
    not kept it: in CI a click straight after a fill once read the old value, and a fill just after the Advanced
    accordion opened was once lost outright (the field read 0 for the next 5 s)."""
    for _ in range(tries - 1):
        box.fill(value)
        box.press("Tab")
        try:
            expect(box).to_have_value(value, timeout=1000)
            return
        except AssertionError:
            pass
    box.fill(value)
    box.press("Tab")
    expect(box).to_have_value(value)


def panel(page):
    return page.get_by_role("tabpanel").filter(visible=True)   # the selected tab's content


def test_the_page_opens(page):
    expect(page).to_have_title("CaPT Playground", timeout=SLOW)
    expect(page.get_by_role("heading", name="CaPT Playground")).to_be_visible(timeout=SLOW)
    for name in ("Predict", "Attention", "Train", "API"):
        expect(page.get_by_role("tab", name=name, exact=True)).to_be_visible()
    expect(field(page, "Backbone")).to_have_value("tiny-llama", timeout=SLOW)   # never loads SmolLM2 here
    expect(field(page, "Capsule")).to_have_value("none (zero-shot)")
    expect(field(page, "Task")).to_have_value("rte")
    no_trouble(page)


def test_predict_shows_probabilities_and_a_report(page):
    page.get_by_role("tab", name="Predict", exact=True).click()
    page.get_by_label("premise", exact=True).fill("A man is playing a guitar on stage.")
    page.get_by_label("hypothesis", exact=True).fill("Someone is making music.")
    page.get_by_role("button", name="Predict", exact=True).click()
    probs = chart(panel(page), "label probabilities with and without the capsule")
    shows(page, probs)
    expect(probs).to_contain_text("rte on tiny-llama")   # the chart's title and its two bars' labels
    expect(probs).to_contain_text("not_entailment")
    expect(probs.locator(".bars .point")).to_have_count(2)
    expect(panel(page).get_by_text(re.compile(r"^without capsule: (entailment|not_entailment) \(\d+\.\d %\)$"))) \
        .to_be_visible()
    expect(panel(page).get_by_text("No capsule: the bare backbone (zero-shot).")).to_be_visible()
    no_trouble(page)
    screenshot(page, "predict.png")
    # the continuation, below: the prompt and what the bare backbone writes after it
    panel(page).get_by_text("What the backbone writes after the prompt", exact=False).click()
    panel(page).get_by_role("button", name="Generate", exact=True).click()
    # exact: the continuation's own heading; the report above starts "without capsule: <label>", which a
    # case-insensitive match found before Generate had answered (and, when it had, two elements: a strict error)
    expect(panel(page).get_by_text("Without capsule", exact=True)).to_be_visible(timeout=SLOW)
    expect(panel(page).get_by_text("Someone is making music.", exact=False).last).to_be_visible()
    no_trouble(page)


def test_attention_shows_the_heatmaps(page):
    page.get_by_role("tab", name="Attention", exact=True).click()
    page.get_by_role("button", name="Show attention", exact=True).click()
    view = panel(page)
    maps = {label: chart(view, label) for label in ("with the capsule", "without (the sink)",
                                                    "anchor mass: layers × heads", "sink mass: layers × heads")}
    shows(page, maps["with the capsule"])
    for label, fig in maps.items():
        expect(fig, label).to_be_visible()
        expect(fig.locator(".hm"), f"{label}: a drawn heatmap").to_have_count(1)
    expect(maps["with the capsule"]).to_contain_text("with untrained capsule (W=0) — mean over layers and heads")
    expect(maps["without (the sink)"]).to_contain_text("without capsule — mean over layers and heads")
    expect(chart(view, "per layer")).to_contain_text("Anchor vs. sink")
    expect(view.get_by_text(re.compile(r"positions with the untrained capsule \(W=0\), \d+ without · "
                                       r"4 layers × 4 heads\. Mean attention"))).to_be_visible()
    no_trouble(page)
    screenshot(page, "attention.png")

    # it follows the input: an edited premise (on leaving the box) redraws the view for the new text
    summary = view.get_by_text(re.compile(r"^\d+ positions with the untrained capsule"))
    before = int(summary.inner_text().split()[0])
    page.get_by_label("premise", exact=True).fill("A man is playing a guitar on stage in front of a very large "
                                                  "crowd of cheering people on a warm summer night.")
    page.get_by_label("premise", exact=True).press("Tab")
    expect(summary).not_to_have_text(re.compile(rf"^{before} positions"), timeout=SLOW)
    assert int(summary.inner_text().split()[0]) > before
    no_trouble(page)


def test_train_then_stop_keeps_the_best_capsule(page, tmp_path):
    page.get_by_role("tab", name="Train", exact=True).click()
    view = panel(page)
    expect(field(view, "Backbone")).to_have_value("tiny-llama", timeout=SLOW)
    expect(field(view, "Task")).to_have_value("cb")
    view.get_by_role("radio", name="quick: 20 steps").check()
    view.get_by_text("Advanced", exact=True).click()
    steps = view.get_by_label("max steps (0: the preset's)")
    fill_until_kept(steps, "2000")   # time enough to press Stop
    view.get_by_role("button", name="Train", exact=True).click()

    # live progress: the step counter (out of the 2000 asked for) and the loss curve
    running = view.get_by_text(re.compile(r"^step \d+/\d+ · loss \d+\.\d+ · .* examples/s · ETA "))
    shows(page, running)
    total = int(re.search(r"^step \d+/(\d+)", running.inner_text()).group(1))
    assert total > 20, running.inner_text()   # max steps 2000 (CB: up to 50 epochs, 1450), not the preset's 20
    expect(chart(view, "loss")).to_contain_text("Training loss")

    view.get_by_role("button", name="Stop", exact=True).click()
    stopping = page.locator(".toast-body.info").filter(has_text="the best capsule so far is kept")
    expect(stopping.first).to_be_visible(timeout=SLOW)
    done = view.get_by_text(re.compile(r"^Done \(stop requested\): \d+ steps in \d+ s, best dev at step \d+\."))
    shows(page, done)
    expect(done).to_contain_text("The capsule is now selected in Predict and Attention.")
    steps, best = map(int, re.search(r"(\d+) steps in .* best dev at step (\d+)", done.inner_text()).groups())
    assert 1 <= best <= steps < 110, done.inner_text()   # stopped early: the run asked for 2000 (patience: 110)
    expect(chart(view, "dev")).to_contain_text("best (kept)")

    # the capsule's zip is offered for download, and is one
    zip_block = block(view, "the new capsule (.zip)")
    expect(zip_block.get_by_role("cell", name=re.compile(r"^\S*tiny-llama\S*cb\S*\.zip$"))).to_be_visible()
    with page.expect_download() as download:
        zip_block.get_by_test_id("download-link").click()
    saved = tmp_path / download.value.suggested_filename
    assert saved.suffix == ".zip", saved.name
    download.value.save_as(saved)
    with zipfile.ZipFile(saved) as z:
        assert {"capsule/capsule.json", "capsule/capsule.safetensors"} <= set(z.namelist())
    no_trouble(page)
    screenshot(page, "train.png")

    # ... and it is selected in Predict: its prediction's report says how it was trained
    page.get_by_role("tab", name="Predict", exact=True).click()
    label = re.compile(rf"^trained: cb · (.* · )?{steps} steps · ")   # the capsule's label in the list
    expect(field(page, "Capsule")).to_have_value(label, timeout=SLOW)
    expect(field(page, "Task")).to_have_value("cb")
    page.get_by_role("button", name="Predict", exact=True).click()
    trained = panel(page).get_by_text(re.compile(rf"^Trained on cb: {steps} steps \(stop requested\); test "))
    shows(page, trained)
    expect(panel(page).get_by_text(re.compile(r"^with capsule: \w+ \(\d+\.\d %\)"))).to_be_visible()
    no_trouble(page)

    # its zip uploaded back (as a colleague would) is chosen with its task, as if picked from the list
    task = field(page, "Task")
    task.click()
    page.get_by_role("option", name="rte", exact=True).click()
    expect(task).to_have_value("rte")
    page.locator("input[type=file]").filter(visible=False).first.set_input_files(str(saved))
    expect(field(page, "Capsule")).to_have_value(re.compile(r"^uploaded: .*cb.* \(cb\)$"), timeout=SLOW)
    expect(task).to_have_value("cb", timeout=SLOW)
    no_trouble(page)


def test_free_text_trains_and_continues_your_own_prompt(page, tmp_path):
    """The Train tab's free-text source: its own column boxes (the task's label boxes hidden), a prompt →
    completion file trained, and the new capsule continuing your own prompt in Predict's generation view, which
    opens for it with a note on what such a capsule is for."""
    page.get_by_role("tab", name="Predict", exact=True).click()
    own = panel(page).get_by_role("textbox", name=re.compile(r"^your own prompt \(optional\) generate after"))
    if own.is_visible():   # open after the tests before: closed, so that its opening below is the app's doing
        panel(page).get_by_text("What the backbone writes after the prompt", exact=False).click()
    expect(own).to_be_hidden()
    page.get_by_role("tab", name="Train", exact=True).click()
    view = panel(page)
    view.get_by_role("radio", name="my text: prompt → completion").check()
    for box in ("prompt", "completion"):   # the box's name: its label, then its info line
        expect(view.get_by_role("textbox", name=re.compile(f"^{box} column "))).to_have_value(box)
    expect(field(view, "label words")).to_have_count(0)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(f'{{"prompt": "say {w}:", "completion": " {w} {w}"}}\n'
                            for w in ["cat", "dog", "sun", "tree", "sea", "sky", "hat", "cup", "pen", "box"]))
    block(view, "CSV / JSONL / JSON").locator("input[type=file]").set_input_files(str(data))
    expect(block(view, "CSV / JSONL / JSON").get_by_role("cell", name="pairs.jsonl")).to_be_visible(timeout=SLOW)
    steps = view.get_by_label("max steps (0: the preset's)")
    if not steps.is_visible():   # the Advanced accordion, open or not after the test before
        view.get_by_text("Advanced", exact=True).click()
    fill_until_kept(steps, "3")
    view.get_by_role("button", name="Train", exact=True).click()
    done = view.get_by_text(re.compile(r"^Done \(max_steps\): 3 steps in \d+ s, best dev loss \d+\.\d+ at step \d+"))
    shows(page, done)
    expect(done).to_contain_text("try it in the Predict tab's generation view with your own prompt")
    expect(chart(view, "dev")).to_contain_text("selection: loss")

    page.get_by_role("tab", name="Predict", exact=True).click()
    view = panel(page)
    expect(field(page, "Capsule")).to_have_value(re.compile(r"^trained: free text · 3 steps"))
    expect(own).to_be_visible()
    expect(page.get_by_text("This capsule was trained on free text, not on a task's labels")).to_be_visible()
    fill_until_kept(own, "say cat:")
    view.get_by_role("button", name="Generate", exact=True).click()
    expect(view.get_by_text(re.compile(r"^With capsule \(computed once"))).to_be_visible(timeout=SLOW)
    expect(view.locator("code").filter(has_text="say cat:").first).to_be_visible()   # the prompt shown as typed
    no_trouble(page)
    page.get_by_role("tab", name="Train", exact=True).click()
    panel(page).get_by_role("radio", name="built-in task").check()   # as the page was


def test_an_upload_over_the_limit_is_refused_with_a_message(page, tmp_path):
    """A 2 MB 'capsule' against the 1 MB limit the server was started with: a message, and the page works on."""
    page.get_by_role("tab", name="Predict", exact=True).click()
    big = tmp_path / "big.zip"
    big.write_bytes(os.urandom(2 * 1024 * 1024))
    page.locator("input[type=file]").filter(visible=False).first.set_input_files(str(big))
    refusal = page.locator(".toast-body.error, .toast-body.warning").filter(has_text=re.compile("size|large", re.I))
    expect(refusal.first).to_be_visible(timeout=SLOW)
    page.get_by_role("button", name="Predict", exact=True).click()   # still serving
    expect(chart(panel(page), "label probabilities with and without the capsule")).to_be_visible(timeout=SLOW)
