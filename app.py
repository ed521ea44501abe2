"""CaPT Playground: predict with a capsule, see its attention anchor, train one. `python app.py` serves it offline.

Handlers are plain functions calling `capt` (no Gradio inside); `build_demo()` only lays out and wires them."""
import functools
import inspect
import json
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

import capt
from capt import CaptError, viz
from capt.analysis import PAPER_KS, probe_on_val
from capt.backbones import canonical_name
from capt.config import FUSIONS, HEADS, LAYER_PRESETS, PLACEMENTS
from capt.hub import check_repo_id, is_repo_id
from capt.io import (capsule_task, export_zip, find_capsules, find_soft_prompts, import_zip, pull_from_hub,
                     push_to_hub, read_config)
from capt.training import TrainConfig, in_chunks, prepare_data, train, train_in_chunks

try:   # Hugging Face ZeroGPU Spaces: a GPU is lent per call of a function decorated with spaces.GPU
    import spaces
    GPU = spaces.GPU
except ImportError:   # locally and on CPU Spaces: plain calls
    GPU = None
MAIN_PID = os.getpid()

SHIPPED = Path(__file__).resolve().parent / "capsules"
WORK_DIR = Path(os.environ.get("CAPT_APP_DIR", Path(tempfile.gettempdir()) / "capt-app"))
DEFAULT = os.environ.get("CAPT_APP_BACKBONE", capt.DEFAULT_BACKBONE)
BACKBONES = list(dict.fromkeys([DEFAULT, "smollm2-135m", "gemma3-270m", "tiny-llama"]))
NONE, CUSTOM = "none", "custom"   # capsule value of the bare backbone; task value of a capsule's own task
FIELDS = ["premise", "hypothesis", "passage", "question", "paragraph", "answer", "sentence1", "sentence2", "word",
          "choice1", "choice2"]   # the union of the six tasks' fields (COPA's question: "cause" or "effect")
PRESETS = {"quick: 20 steps": dict(max_steps=20, eval_every=10, max_dev=64, max_test=128),
           "short: 5 minutes": dict(max_minutes=5, eval_every=25, max_dev=128, max_test=256),
           "long: 30 minutes": dict(max_minutes=30, eval_every=50, max_dev=256, max_test=512),
           "paper protocol (hours on CPU)": dict(eval_every=50)}
OWN_FILE = "my file (CSV / JSONL)"
OWN_TEXT = "my text: prompt → completion"   # free text: capt.lm_training.train_lm, a capsule and no task
TEXT_PRESETS = {"quick: 20 steps": dict(max_steps=20, eval_every=10),   # python -m train.lm's budgets
                "short: 5 minutes": dict(max_steps=100_000, max_minutes=5, eval_every=25),
                "long: 30 minutes": dict(max_steps=100_000, max_minutes=30, eval_every=50),
                "paper protocol (hours on CPU)": dict(max_steps=500, eval_every=50)}
TRAIN_METHODS = {"capt": "CaPT (a capsule)", "deep-prompt-1": "deep prompt, 1 token per layer (no instance mean)",
                 "prompt-tuning": "PEFT prompt tuning (a soft prompt)", "p-tuning-v2": "PEFT P-tuning v2 (prefix)",
                 "linear-head": "linear head on the frozen backbone"}
GPU_CHUNK_S = int(os.environ.get("CAPT_GPU_CHUNK_S", 240))   # ZeroGPU: seconds of training per GPU call
API_DOC = """Every action is an endpoint (`/predict`, `/generate`, `/attention`, `/probe`, `/train`, `/stop`; see
"Use via API").
One `gradio_client.Client` is one session: the capsule `/train` returns (its 8th output) stays usable for it:
```python
c = gradio_client.Client("http://127.0.0.1:7860/")
capsule = c.predict(backbone="smollm2-135m", task="cb", preset="quick: 20 steps", api_name="/train")[7]["value"]
fig, report, error = c.predict(capsule=capsule, task="cb", premise="It rained.", hypothesis="Wet.", api_name="/predict")
```
Free text: `/train` with `source="my text: prompt → completion"`, `data_file=gradio_client.handle_file("qa.jsonl")`,
`prompt_column`, `completion_column`; then `/generate` with `own_prompt` continues your text with the new capsule."""
_MODELS, _LOCK = {}, threading.Lock()      # name -> Backbone, read-only once loaded: capsules attach per call
_STOPS: dict[str, "StopFile"] = {}          # session id -> the stop flag of the training it runs


class StopFile:
    """A stop flag that also reaches another process: ZeroGPU runs each GPU call in a forked worker and pickles
    its arguments there (a threading.Event cannot be pickled). set() creates the file; train() polls is_set()
    once a step (one stat call)."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    def set(self) -> None:
        Path(self.path).touch()

    def is_set(self) -> bool:
        return os.path.exists(self.path)


def get_backbone(name: str) -> capt.Backbone:
    key = canonical_name(name)
    if not key:
        raise CaptError("choose a backbone or type a hub id")
    if key not in _MODELS:
        with _LOCK:     # one load at a time; loaded backbones keep serving meanwhile
            if key not in _MODELS:
                _MODELS[key] = capt.load_backbone(key)
    return _MODELS[key]


def session_dir(session: dict) -> Path:
    session["dir"] = session.get("dir") or str(WORK_DIR / uuid.uuid4().hex)
    Path(session["dir"]).mkdir(parents=True, exist_ok=True)
    return Path(session["dir"])


def capsule_choices(backbone: str, session: dict | None) -> list[tuple[str, str]]:
    """(label, value): zero-shot, this backbone's shipped capsules, this session's trained or uploaded ones."""
    key = canonical_name(backbone)
    out = [("none (zero-shot)", NONE)] + [(f"shipped: {c.name}", str(c)) for c in find_capsules(SHIPPED, key)]
    return out + [(c["label"], c["path"]) for c in (session or {}).get("capsules", []) if c["backbone"] == key]


def known_capsule(value: str, session: dict | None) -> bool:   # only these are read, not a typed-in path
    return value in {str(c) for c in find_capsules(SHIPPED)} | {c["path"] for c in (session or {}).get("capsules", [])}


def from_hub(repo_id: str, session: dict | None) -> str:
    """A capsule typed in as a Hub repo id: downloaded (capsule files only) and added to the session's list."""
    repo_id = repo_id.strip()
    if not is_repo_id(repo_id):
        raise CaptError(f"unknown capsule {repo_id!r}: choose one from the list, train or upload one, or type a "
                        "Hub repo id like 'user/capt-cb'")
    folder = str(pull_from_hub(repo_id))   # a clear CaptError when the Hub is unreachable or the repo missing
    if session is not None:
        owner = read_config(folder)["backbone"]["name"]
        session.setdefault("capsules", []).append({"label": f"hub: {repo_id}", "path": folder, "backbone": owner})
    return folder


def push_capsule(repo_id: str, token: str, session: dict | None, private: bool = True, capsule: str = "") -> str:
    """Push one of this session's trained capsules (default: the latest) to the Hub, private by default; returns
    a message."""
    try:
        mine = [c["path"] for c in (session or {}).get("capsules", []) if c["label"].startswith("trained")]
        capsule = capsule or (mine[-1] if mine else "")
        if not capsule or capsule not in mine:
            raise CaptError("train a capsule in this session first: only those can be pushed from here")
        repo_id = check_repo_id(repo_id)
        if not (token or "").strip():
            raise CaptError("give a Hugging Face write token (huggingface.co/settings/tokens); it is used for this "
                            "push only and never stored")
        url = push_to_hub(capsule, repo_id, token=token.strip(), private=bool(private))
        return f"Pushed to {url} ({'private' if private else 'public'})."
    except Exception as e:
        return viz.error_message(e)


def soft_prompt_choices(backbone: str, session: dict | None) -> list[tuple[str, str]]:
    """(label, value): no comparison, this backbone's shipped soft prompts, this session's trained ones."""
    key = canonical_name(backbone)
    shipped = [(f"shipped: {p.parent.name}/{p.name}", str(p)) for p in find_soft_prompts(SHIPPED, key)]
    mine = [(c["label"], c["path"]) for c in (session or {}).get("soft_prompts", []) if c["backbone"] == key]
    return [("none", NONE)] + shipped + mine


def known_soft_prompt(value: str, session: dict | None) -> bool:
    return value in {str(p) for p in find_soft_prompts(SHIPPED)} | {
        c["path"] for c in (session or {}).get("soft_prompts", [])}


def resolve(backbone: str, capsule: str, task: str, session: dict | None):
    """(backbone, capsule or None, task, notes)."""
    bb, cap, cap_task = load_chosen(backbone, capsule, session)
    notes = []
    if task == CUSTOM and (cap_task is None or cap_task in capt.TASKS.values()):
        raise CaptError("the 'custom' task needs a capsule trained on your own data; select one")
    t = cap_task if task == CUSTOM else capt.get_task(task)
    if cap_task is not None and cap_task.name != t.name:   # capt.predict refuses a linear head of another size
        notes.append(f"this capsule was trained on '{cap_task.name}', not '{t.name}'")
    return bb, cap, t, notes


def load_chosen(backbone: str, capsule: str, session: dict | None):
    """(backbone, capsule or None, the capsule's task or None) for the boxes' values."""
    bb, cap, cap_task = get_backbone(backbone), None, None
    if capsule and capsule != NONE:
        if not known_capsule(capsule, session):
            capsule = from_hub(capsule, session)
        cap, cap_task = capt.load_capsule(capsule, bb)
    return bb, cap, cap_task


FREE_TEXT_NOTE = ("This capsule was trained on free text, not on a task's labels: type a prompt under *What the "
                  "backbone writes after the prompt* and press Generate to see what it learned (Predict scores the "
                  "Task box's labels with it).")


def task_choice(value: str, session: dict | None) -> tuple[str | None, str, bool]:
    """What choosing a capsule sets: the Task box (a built-in task's name, or CUSTOM and a JSON template of its
    fields; None: leave it) and whether it was trained on free text (no task: the generation view opens)."""
    try:
        known = value != NONE and known_capsule(value, session)
        task = capsule_task(value) if known else None
    except CaptError:   # a broken capsule: leave the task as it is, Predict will say what is wrong
        return None, "", False
    if task is None or task in capt.TASKS.values():
        return getattr(task, "name", None), "", known and task is None
    return CUSTOM, json.dumps({f: "" for f in task.fields}), False


def upload_capsule(zip_path: str | None, backbone: str, session: dict) -> tuple[dict, str | None, str]:
    """Unpack an uploaded capsule .zip into the session: (session, value to select or None, message)."""
    try:
        folder = import_zip(zip_path or "", session_dir(session) / "uploads" / uuid.uuid4().hex[:8])
        owner, task = read_config(folder)["backbone"]["name"], capsule_task(folder)
        session["capsules"].append({"label": f"uploaded: {Path(zip_path).stem} ({getattr(task, 'name', 'no task')})",
                                    "path": str(folder), "backbone": owner})
        if owner != canonical_name(backbone):
            return session, None, (f"This capsule was trained for backbone '{owner}', not '{backbone}'. It is kept in "
                                   f"this session's list for '{owner}': select that backbone to use it.")
        return session, str(folder), ""
    except Exception as e:
        return session, None, viz.error_message(e)


def make_example(task: capt.Task, fields: dict, picked: dict | None = None) -> dict:
    """The task's example from the form: the FIELDS boxes, or for a custom task the JSON box 'custom_fields'. While
    the boxes hold the val example `picked`, its extras come too (WiC's word span: lm-eval's prompt for it)."""
    if task in capt.TASKS.values():
        example = {f: fields.get(f) or "" for f in task.fields}
        if picked and all(picked.get(f) == v for f, v in example.items()):
            example.update({k: picked[k] for k in task.extras if picked.get(k) is not None})
        return example
    try:
        values = json.loads(fields.get("custom_fields") or "{}")
        return {f: values.get(f) for f in task.fields}
    except (json.JSONDecodeError, AttributeError) as e:
        raise CaptError(f"the custom fields must be a JSON object like {{\"text\": \"...\"}} ({e})") from None


def example_from_val(task: str, seed: int | None = None, whole: bool = False) -> tuple:
    """A random val example's form fields and a note with its gold label; whole=True adds the whole example, with
    its task's extras (WiC's word span), for the UI state that make_example's `picked` reads."""
    t = capt.get_task(task)
    ex = random.Random(seed).choice(capt.load_examples(t, "val"))
    gold = t.labels[ex["label"]] if ex.get("label") is not None else "unlabelled"
    note = f"{t.name} val example idx {ex['idx']} · gold label: **{gold}**"
    return ({f: ex[f] for f in t.fields}, note) + ((ex,) if whole else ())


def visible_fields(task: str) -> list[bool]:   # which boxes a task uses: FIELDS, then the custom JSON box
    return [task != CUSTOM and f in capt.get_task(task).fields for f in FIELDS] + [task == CUSTOM]


def predict_view(backbone: str, capsule: str = NONE, task: str = "rte", session: dict | None = None,
                 hub_id: str = "", picked: dict | None = None, **fields):
    """(probability figure, markdown report, error message) for one example, with and without the capsule."""
    try:
        bb, cap, t, notes = resolve(hub_id or backbone, capsule, task, session)
        example = make_example(t, fields, picked)
        bare = capt.predict(bb, t, example)
        mine = capt.predict(bb, t, example, capsule=cap) if cap is not None else None
        return *viz.prediction_panel(t, bb, bare, mine, cap, notes), ""
    except Exception as e:
        return None, "", viz.error_message(e)


def generate_view(backbone: str, capsule: str = NONE, task: str = "rte", session: dict | None = None,
                  hub_id: str = "", picked: dict | None = None, max_new_tokens: int = 24, own_prompt: str = "",
                  **fields):
    """(markdown, error message): what the backbone writes after the example's prompt (greedy, capt.generate),
    or after `own_prompt` as typed when it is not empty (what a capsule trained on free text is for: the Train
    tab's or `python -m train.lm`'s), without and with the capsule. Prediction itself never generates; this shows
    what else the capsule changes."""
    try:
        if (own_prompt or "").strip():   # no task involved: the backbone and the capsule alone
            (bb, cap, _), notes, prompt = load_chosen(hub_id or backbone, capsule, session), [], own_prompt
        else:
            bb, cap, t, notes = resolve(hub_id or backbone, capsule, task, session)
            prompt = t.render(make_example(t, fields, picked), bb.style).prompt
        n = int(max_new_tokens)
        bare = capt.generate(bb, prompt, max_new_tokens=n)
        mine = capt.generate(bb, prompt, capsule=cap, max_new_tokens=n) if cap is not None else None
        return viz.generation_markdown(prompt, bare, mine, notes), ""
    except Exception as e:
        return "", viz.error_message(e)


def attention_view(backbone: str, capsule: str = NONE, task: str = "rte", layer: int = -1, head: int = -1,
                   session: dict | None = None, hub_id: str = "", picked: dict | None = None,
                   soft_prompt: str = NONE, **fields):
    """(maps with / without / with the soft prompt, anchor mass the same three, per layer, markdown, error);
    layer/head -1: the mean. With no capsule chosen, an untrained one (W = 0: the instance mean alone, a
    training-free pooled token) is the anchor. The soft-prompt figures are None unless one is chosen."""
    try:
        (bb, cap, t, _), name = resolve(hub_id or backbone, capsule, task, session), "capsule"
        if cap is None:
            cap, name = capt.Capsule.for_backbone(bb, n_labels=len(t.labels)), "untrained capsule (W=0)"
        soft, soft_name = None, "soft prompt"
        if soft_prompt and soft_prompt != NONE:
            if not known_soft_prompt(soft_prompt, session):
                raise CaptError(f"unknown soft prompt {soft_prompt!r}: choose one from the list, or train one "
                                "(Train tab, method prompt-tuning) first")
            soft = capt.load_soft_prompt(soft_prompt, bb)
            soft_name = f"soft prompt ({soft.embeddings.shape[0]} tokens)"
        # the text the capsule's scoring reads (a linear head's lists COPA's alternatives)
        prompt = t.render(make_example(t, fields, picked), bb.style).text_for(head=cap.head is not None)
        with_r, without_r = capt.attention(bb, prompt, capsule=cap), capt.attention(bb, prompt)
        soft_r = capt.attention(bb, prompt, soft_prompt=soft) if soft is not None else None
        figs, text = viz.attention_panel(with_r, without_r, int(layer), int(head), name, soft_r, soft_name)
        return *figs, text, ""
    except Exception as e:
        return (None,) * 7 + ("", viz.error_message(e))


def probe_view(backbone: str, capsule: str = NONE, task: str = "rte", n_examples: int = 32, ks=PAPER_KS,
               session: dict | None = None, hub_id: str = "", seed: int = 0):
    """The paper's training-free probe: (accuracy bars for k = 0 and each k in ks, markdown, error) on a fixed
    random sample of the task's val split. The capsule is used as trained, with k mean-pooled instance tokens
    prepended at every capsule layer; with no capsule, an untrained deep prompt (W = 0)."""
    try:
        bb, cap, t, notes = resolve(hub_id or backbone, capsule, task, session)
        r = probe_on_val(bb, t, cap, n_examples, ks, seed)
        name = "the chosen capsule" if cap is not None else r.subject
        fig = viz.probe_figure(r.accuracy, r.n_examples, f"{t.name} on {bb.name}: k pooled tokens before {name}")
        best = max(r.accuracy, key=r.accuracy.get)
        text = (f"Accuracy of {name} on {r.n_examples} random {t.name} val examples (seed {seed}) with k mean-pooled "
                f"instance tokens prepended at every capsule layer, nothing trained: "
                + " · ".join(f"k={k}: **{100 * a:.1f} %**" for k, a in r.accuracy.items())
                + f". Best: k={best}. The paper finds one pooled token helps and more tokens hurt.")
        return fig, text + "".join(f"\n\n⚠ {x}" for x in notes), ""
    except Exception as e:
        return None, "", viz.error_message(e)


def parse_label_words(text: str) -> dict:
    """'pos=good, neg=bad' (or one label=word per line) -> {"pos": "good", "neg": "bad"}."""
    pairs = [p.partition("=") for p in (text or "").replace("\n", ",").split(",") if p.strip()]
    bad = [raw + sep + word for raw, sep, word in pairs if not (sep and raw.strip() and word.strip())]
    if bad or len(pairs) < 2:
        raise CaptError(f"label words: give two or more label=word pairs, e.g. pos=good, neg=bad (not {bad or text!r})")
    return {raw.strip(): word.strip() for raw, _, word in pairs}


def train_config(backbone: str, task: str, preset: str, out_dir: str, data_file: str | None = None,
                 columns: str = "", label_column: str = "label", label_words: str = "", lr: float | None = None,
                 max_steps: int | None = None, batch_size: int = 8, seed: int = 0, fusion: str = "add",
                 placement: str = "slot", layers: str = "all", head: str = "verbalizer",
                 method: str = "capt", hub_dataset: str = "") -> TrainConfig:
    """A validated TrainConfig: a built-in task, or the user's file (`task` names it) when data_file is set.
    lr 0 / None: the method's default; the capsule options only matter to capt and deep-prompt-1."""
    if preset not in PRESETS:
        raise CaptError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    if method not in TRAIN_METHODS:
        raise CaptError(f"unknown method {method!r}; valid: {', '.join(TRAIN_METHODS)}")
    cfg = {**PRESETS[preset], **({"max_steps": int(max_steps), "max_minutes": None} if max_steps else {})}
    cfg.update(method=method, backbone=canonical_name(backbone), lr=float(lr) if lr else None,
               batch_size=int(batch_size or 8), seed=int(seed or 0), out_dir=out_dir,
               capsule=dict(fusion=fusion, placement=placement, layers=str(layers or "all").strip(), head=head))
    if not data_file and str(task).lower() not in capt.TASKS:
        raise CaptError(f"no data for task {task!r}: upload a file, or choose one of {', '.join(capt.TASKS)}")
    if not data_file:
        hub = (hub_dataset or "").strip() or None   # SuperGLUE-shaped data from the Hub (TrainConfig checks the id)
        return TrainConfig(task=capt.get_task(task).name, source=hub, **cfg)
    pairs = [p.split("=", 1) if "=" in p else (p, p) for p in (columns or "").split(",") if p.strip()]
    if not pairs:
        raise CaptError("name the input column(s) of your file, e.g. 'text', 'premise, hypothesis' or 'review=text'")
    mapping = {f.strip(): c.strip() for f, c in pairs}
    return TrainConfig(task=(task or "").strip() or "custom", data_file=data_file, fields=list(mapping),
                       columns=mapping, label_column=(label_column or "label").strip(),
                       label_words=parse_label_words(label_words), **cfg)


def stop_training(session_id: str) -> str:
    if (event := _STOPS.get(session_id)) is None:
        return "No training is running in this session."
    return event.set() or "Stopping after this step; the best capsule so far is kept."


def train_run(backbone: str, task: str, preset: str, session: dict, session_id: str = "local", **options):
    """Yields UI states (figures, progress, session; at the end the capsule, its zip and task) while a thread trains."""
    state = _initial_state(session)
    try:
        cfg = train_config(backbone, task, preset, str(new_run_dir(session)), **options)
    except Exception as e:
        yield {**state, "error": viz.error_message(e)}
        return

    def work(emit, stop):
        emit({"kind": "info", "text": "checking the data…"})
        prepare_data(cfg)   # a bad file fails here, before any backbone is loaded
        emit({"kind": "info", "text": f"loading backbone {cfg.backbone}, then training…"})
        bb = get_backbone(cfg.backbone)   # in the main process: a ZeroGPU worker forked after this inherits it
        emit({"kind": "finished", "summary": run_training(cfg, bb, emit, stop)})
    yield from _stream_training(state, work, _finish, session, session_id)


def new_run_dir(session: dict) -> Path:
    """A fresh folder name for one training run of this session."""
    return session_dir(session) / f"run-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"


def _initial_state(session: dict) -> dict:
    return dict(loss=None, dev=None, progress="", session=session, capsule=None, zip=None, task=(None, "", False),
                error="", runs=viz.runs_table(session.get("runs", [])))


def _stream_training(state: dict, work, finish, session: dict, session_id: str):
    """Run `work(emit, stop)` in a thread and yield the UI state as its events come: the live curves and progress
    line, at the end `finish(summary, session)`'s updates or the error. The session's Stop button sets `stop`."""
    stop, curves = StopFile(session_dir(session) / f"stop-{uuid.uuid4().hex}"), viz.TrainingCurves()
    _STOPS[session_id] = stop
    try:
        for batch in curves.watch(lambda emit: work(emit, stop), on_error=viz.error_message):
            state["progress"] = curves.text
            for ev in batch:
                state.update(finish(ev["summary"], session) if ev["kind"] == "finished" else
                             {"error": ev["text"]} if ev["kind"] == "error" else {})
            state["loss"], state["dev"] = curves.figures()
            yield dict(state)
    finally:
        stop.set()   # a no-op after the end; if the page went away, the worker ends within one step
        _STOPS.pop(session_id, None)


def train_text_run(backbone: str, preset: str, session: dict, session_id: str = "local", data_file: str | None = None,
                   prompt_column: str = "prompt", completion_column: str = "completion", lr: float | None = None,
                   max_steps: int | None = None, batch_size: int = 8, seed: int = 0, fusion: str = "add",
                   placement: str = "slot", layers: str = "all", head: str = "verbalizer", method: str = "capt"):
    """train_run for free text: a capsule trained on the prompt → completion rows of the user's file with the
    backbone's own language-modelling loss (capt.lm_training.train_lm: the dev loss picks the capsule kept);
    the same UI states, ending with the capsule selected for the generation view."""
    state = _initial_state(session)
    try:
        if method != "capt":
            raise CaptError(f"free text trains a CaPT capsule; {TRAIN_METHODS.get(method, method)} runs on a "
                            "classification task or file: choose the method 'capt'")
        if preset not in TEXT_PRESETS:
            raise CaptError(f"unknown preset {preset!r}; valid: {', '.join(TEXT_PRESETS)}")
        if not data_file:
            raise CaptError("upload a CSV / JSONL / JSON file with a prompt and a completion column")
        config = capt.CapsuleConfig(fusion=fusion, placement=placement, layers=str(layers or "all").strip(),
                                    head=head)
        budget = {**TEXT_PRESETS[preset], **({"max_steps": int(max_steps), "max_minutes": None} if max_steps else {})}
        options = dict(batch_size=int(batch_size or 8), **budget, **({"lr": float(lr)} if lr else {}))  # 0: default
        columns = ((prompt_column or "").strip() or "prompt", (completion_column or "").strip() or "completion")
        out = new_run_dir(session)
        from capt.lm_training import check_options, read_pairs, train_lm
        check_options(out, config=config, **options)
    except Exception as e:
        yield {**state, "error": viz.error_message(e)}
        return
    name = canonical_name(backbone)

    options.update(seed=int(seed or 0), command=f"the app's Train tab: {Path(data_file).name}, {preset}")

    def work(emit, stop):
        emit({"kind": "info", "text": "checking the data…"})
        pairs = read_pairs(data_file, *columns)   # a bad file fails here, before any backbone is loaded
        emit({"kind": "info", "text": f"loading backbone {name}, then training…"})
        bb = get_backbone(name)   # in the main process: a ZeroGPU worker forked after this inherits it
        if gpu_text_chunk is None:
            summary = train_lm(bb, pairs, out, config, callback=emit, stop=stop.is_set, **options)
        else:   # ZeroGPU: GPU_CHUNK_S of training per GPU call, each resuming where the one before ended
            summary = in_chunks(lambda budget, resume: gpu_summary(gpu_text_chunk(
                name, pairs, str(out), config, {**options, "max_minutes": budget}, resume, stop), emit),
                options.get("max_minutes"), GPU_CHUNK_S, callback=emit)
        emit({"kind": "finished", "summary": summary})
    yield from _stream_training(state, work, _finish_text, session, session_id)


def _finish_text(summary: dict, session: dict) -> dict:
    """Register a finished free-text run: its capsule joins the session's list, selected, with its zip."""
    path = Path(summary["capsule_dir"])
    session.setdefault("runs", []).append(viz.lm_run_row(summary, time.strftime("%H:%M:%S")))
    session["capsules"].append({"label": f"trained: free text · {summary['steps']} steps · dev loss "
                                         f"{summary['best_dev_loss']:.3f} · {time.strftime('%H:%M')}",
                                "path": str(path), "backbone": summary["backbone"]})
    name = f"capt-{summary['backbone'].replace('/', '_')}-free-text-{path.parent.name}"
    return {"progress": viz.lm_summary_markdown(summary) + " The capsule is now selected: try it in the Predict "
                        "tab's generation view with your own prompt.",
            "capsule": str(path), "zip": str(export_zip(path, path.parent / f"{name}.zip")),
            "runs": viz.runs_table(session["runs"]), "task": task_choice(str(path), session)}


def train_chunk(cfg: TrainConfig, resume: bool, stop: StopFile):
    """One time-boxed piece of a run (cfg.max_minutes is the run's clock at its end), resuming from the
    checkpoint of the previous piece. A generator of the train callback's events, ending with
    {"kind": "finished", "summary"} or {"kind": "error", "text"}: ZeroGPU runs it in a worker process and
    streams its yields back (a callback could not reach the page from there; every argument and event is
    pickled on the way, so all are plain data)."""
    yield from _chunk_events(lambda emit: train(cfg, get_backbone(cfg.backbone), callback=emit, stop=stop,
                                                resume=resume, progress=False), stop)


def train_text_chunk(name: str, pairs: list, out: str, config: capt.CapsuleConfig, options: dict, resume: bool,
                     stop: StopFile):
    """train_chunk for free text: one time-boxed piece of capt.lm_training.train_lm (options["max_minutes"]: the
    run's clock at its end), resuming from the checkpoint the previous piece ended with."""
    from capt.lm_training import train_lm
    yield from _chunk_events(lambda emit: train_lm(get_backbone(name), pairs, out, config, resume=resume,
                                                   callback=emit, stop=stop.is_set, **options), stop)


def _chunk_events(job, stop: StopFile):
    """job(emit) -> summary, run in a thread: its events, then {"kind": "finished", "summary"} or {"kind": "error",
    "text"}. Closed before its end (the page went away), it sets `stop`: the whole run ends within one step."""
    events = viz.in_thread(lambda emit: emit({"kind": "finished", "summary": job(emit)}), on_error=viz.error_message)
    ended = False
    try:
        while (event := events.get())["kind"] not in ("finished", "error"):
            yield event
        ended = True
        yield event
    finally:
        if not ended:
            stop.set()


def on_gpu(duration: int, fn, gpu=None):
    """spaces.GPU(duration=...)(fn): ZeroGPU runs each call in a worker process forked from this one. There,
    torch first drops to one CPU thread: a fork inherits OpenMP's thread pool in a state the child cannot use,
    and its first multi-threaded CPU operation would hang for good (the GPU does the work there anyway)."""
    def one_thread_if_forked():
        if os.getpid() != MAIN_PID:
            torch.set_num_threads(1)
    if inspect.isgeneratorfunction(fn):   # spaces streams a generator's yields: keep it one
        def body(*args, **kwargs):
            one_thread_if_forked()
            yield from fn(*args, **kwargs)
    else:
        def body(*args, **kwargs):
            one_thread_if_forked()
            return fn(*args, **kwargs)
    return (gpu or GPU)(duration=duration)(functools.wraps(fn)(body))


# ZeroGPU lends a GPU for one decorated call at a time (decorated once, at import, as it requires)
gpu_train_chunk = on_gpu(GPU_CHUNK_S + 60, train_chunk) if GPU else None   # + the chunk's test evaluation
gpu_text_chunk = on_gpu(GPU_CHUNK_S + 60, train_text_chunk) if GPU else None  # + the dev loss, both ways


def run_training(cfg: TrainConfig, bb: capt.Backbone, emit, stop: StopFile) -> dict:
    """capt.training.train; on ZeroGPU the same run in chunks of GPU_CHUNK_S seconds of training, each a GPU call
    that resumes from the checkpoint the previous one left (capt.training.train_in_chunks)."""
    if gpu_train_chunk is None:
        return train(cfg, bb, callback=emit, stop=stop, progress=False)

    return train_in_chunks(cfg, lambda chunk_cfg, resume: gpu_summary(gpu_train_chunk(chunk_cfg, resume, stop), emit),
                           GPU_CHUNK_S, callback=emit)


def gpu_summary(events, emit) -> dict:
    """A GPU chunk's summary, its events passed on to `emit` as they come; its error raised here."""
    for event in events:
        if event["kind"] == "finished":
            return event["summary"]
        if event["kind"] == "error":
            raise CaptError(event["text"])
        emit(event)
    raise CaptError("the GPU call ended before its training chunk did (ZeroGPU aborted it); try again")


def _finish(summary: dict, session: dict) -> dict:
    """Register a finished run in the session: a capsule (capt, deep-prompt-1) is selected in Predict and
    Attention, a soft prompt (prompt-tuning) is offered for the attention comparison; every run joins the table."""
    key, method = summary["selection_metric"], summary["method"]
    session.setdefault("runs", []).append(viz.run_row(summary, time.strftime("%H:%M:%S")))
    out = {"progress": viz.summary_markdown(summary), "capsule": None, "zip": None, "task": (None, "", False),
           "runs": viz.runs_table(session["runs"])}
    if not summary.get("artifact"):   # the linear head keeps nothing to reuse
        return out
    path = Path(summary["artifact"])
    label = (f"trained: {summary['task']} · {method} · {summary['steps']} steps · test {key} "
             f"{100 * summary['test'][key]:.1f} % · {time.strftime('%H:%M')}")
    entry = {"label": label, "path": str(path), "backbone": summary["backbone"]}
    name = f"{method}-{summary['backbone'].replace('/', '_')}-{summary['task']}-{path.parent.name}"
    if path.name == "capsule":
        session["capsules"].append(entry)
        return {**out, "progress": out["progress"] + " The capsule is now selected in Predict and Attention.",
                "capsule": str(path), "zip": str(export_zip(path, path.parent / f"{name}.zip")),
                "task": task_choice(str(path), session)}
    zipped = str(export_zip(path, path.parent / f"{name}.zip"))
    if method == "prompt-tuning":
        session.setdefault("soft_prompts", []).append(entry)
        out["progress"] += " The soft prompt is now offered for comparison in the Attention tab."
    return {**out, "zip": zipped}


if GPU is not None:   # ZeroGPU: each prediction / continuation / attention / probe call holds a GPU while it runs
    predict_view, generate_view, attention_view, probe_view = (on_gpu(d, f) for f, d in (
        (predict_view, 60), (generate_view, 60), (attention_view, 60), (probe_view, 120)))


def build_demo():
    import gradio as gr

    def toast(msg: str) -> str:
        return gr.Warning(msg) or msg if msg else msg

    def warned(fn):     # a handler's last output is its error message: show it as a toast too
        return lambda **kw: (*(out := fn(**kw))[:-1], toast(out[-1]))

    def refresh(backbone, hub_id, capsule, soft, session):
        choices, softs = capsule_choices(hub_id or backbone, session), soft_prompt_choices(hub_id or backbone, session)
        return (gr.update(choices=choices, value=capsule if capsule in [v for _, v in choices] else NONE),
                gr.update(choices=softs, value=soft if soft in [v for _, v in softs] else NONE))

    def slider_ranges(backbone, hub_id):   # after each attention view: the sliders follow the backbone shown
        bb = _MODELS.get(canonical_name(hub_id or backbone))
        if bb is None:
            return gr.skip(), gr.skip()
        return gr.update(maximum=bb.n_layers - 1), gr.update(maximum=bb.n_heads - 1)

    def on_example(task):
        try:
            fields, note, example = example_from_val(task, whole=True)
            return *[fields.get(f, gr.skip()) for f in FIELDS], note, example
        except Exception as e:
            return *[gr.skip()] * len(FIELDS), toast(viz.error_message(e)), None

    def chosen(choice, clear):   # a chosen capsule sets the Task box; one trained on free text opens the generation
        task_name, fields, free = choice   # view with a note; `clear`: the note shown before goes
        return (task_name or gr.skip(), fields or gr.skip(), gr.update(open=True) if free else gr.skip(),
                FREE_TEXT_NOTE if free else "" if clear else gr.skip())

    def on_upload(zip_path, backbone, hub_id, session):
        session, value, err = upload_capsule(zip_path, hub_id or backbone, session)
        return session, gr.update(choices=capsule_choices(hub_id or backbone, session), value=value or NONE), toast(err)

    def on_train(request: gr.Request, source, task_name, session, data_file=None, prompt_column="prompt",
                 completion_column="completion", **kw):
        own, bb, sid = source == OWN_FILE, canonical_name(kw["backbone"]), request.session_hash or "api"
        if source == OWN_TEXT:
            runs = train_text_run(session=session, session_id=sid, data_file=data_file, prompt_column=prompt_column,
                                  completion_column=completion_column, **{k: v for k, v in kw.items() if k not in (
                                      "task", "hub_dataset", "columns", "label_column", "label_words")})
        else:
            kw.update(task=task_name if own else kw["task"], data_file=data_file if own else None)
            runs = train_run(session=session, session_id=sid, **kw)
        for s in runs:
            picks = (bb if bb in BACKBONES else gr.skip(), "" if bb in BACKBONES else bb, gr.update(
                choices=capsule_choices(bb, s["session"]), value=s["capsule"]), *chosen(s["task"], clear=True)) \
                if s["capsule"] else (gr.skip(),) * 7
            softs = gr.update(choices=soft_prompt_choices(bb, s["session"])) if s["zip"] else gr.skip()
            yield (s["loss"], s["dev"], s["progress"], toast(s["error"]), s["zip"], s["session"], *picks, s["runs"],
                   softs)

    def on_stop(request: gr.Request) -> str:
        return gr.Info(msg := stop_training(request.session_hash or "api")) or msg

    def on_close(request: gr.Request) -> None:   # a closed tab stops its training within one step
        stop_training(request.session_hash or "api")

    with gr.Blocks(title="CaPT Playground") as demo:
        session = gr.State({"dir": None, "capsules": []},   # a closed tab's files go with it
                           delete_callback=lambda s: shutil.rmtree(s.get("dir") or "/nonexistent", ignore_errors=True))
        gr.Markdown("# CaPT Playground\nCapsule Prompt-Tuning (NeurIPS 2025): one learnable vector per layer, fused "
                    "with the mean of the input's hidden states, as one token in front: an *attention anchor*.")
        with gr.Column() as inputs_col:
            with gr.Row():
                backbone = gr.Dropdown(BACKBONES, value=DEFAULT, label="Backbone",
                                       info="embedded: offline; tiny-llama: a random 4-layer test model")
                hub_id = gr.Textbox("", label="…or a hub id (Enter)", placeholder="Qwen/Qwen2.5-1.5B",
                                    info="needs the Hugging Face hub, often unreachable here; embedded: always")
                capsule = gr.Dropdown(capsule_choices(DEFAULT, None), value=NONE, label="Capsule",
                                      allow_custom_value=True,
                                      info="shipped, trained / uploaded in this session, or type a Hub repo id")
                task = gr.Dropdown([*capt.TASKS, ("custom: the capsule's task", CUSTOM)], value="rte", label="Task")
            with gr.Row():
                boxes = {f: gr.Textbox("", label=f, lines=4 if f in ("passage", "paragraph") else 1,
                                       visible=f in ("premise", "hypothesis")) for f in FIELDS}
                boxes["question"].info = "COPA: cause or effect"
                custom = gr.Textbox("", label="fields of the capsule's task (JSON)", visible=False)
                boxes["premise"].value, boxes["hypothesis"].value = "The cat sat on the mat.", "A cat was sitting."
            with gr.Row():
                example_btn = gr.Button("Example from val", size="sm")
                zip_up = gr.UploadButton("Upload a capsule (.zip)", file_types=[".zip"], size="sm")
            note = gr.Markdown()
            picked = gr.State(None)   # the val example in the boxes, with its extras (WiC's word span)
            on_attention_tab = gr.State(False)   # the Attention view then follows edits of the input
        with gr.Tabs():
            with gr.Tab("Predict") as tab_predict:
                predict_btn = gr.Button("Predict", variant="primary")
                probs, report = gr.Plot(label="label probabilities with and without the capsule"), gr.Markdown()
                with gr.Accordion("What the backbone writes after the prompt (greedy), without and with the capsule",
                                  open=False) as gen_box:
                    with gr.Row():
                        gen_tokens = gr.Slider(1, 64, value=24, step=1, label="new tokens")
                        gen_btn = gr.Button("Generate", size="sm")
                    own_prompt = gr.Textbox("", label="your own prompt (optional)", lines=2,
                                            info="generate after this text as typed, instead of the task's prompt "
                                                 "(e.g. for a capsule trained on free text)")
                    gen_md = gr.Markdown()
            with gr.Tab("Attention") as tab_attn:
                with gr.Row():
                    layer = gr.Slider(-1, 63, value=-1, step=1, label="layer (-1: mean over layers)")
                    head = gr.Slider(-1, 63, value=-1, step=1, label="head (-1: mean over heads)")
                    soft = gr.Dropdown(soft_prompt_choices(DEFAULT, None), value=NONE,
                                       label="compare with a soft prompt",
                                       info="a trained PEFT prompt-tuning soft prompt: shipped, or trained here")
                    attn_btn = gr.Button("Show attention", variant="primary")
                attn_md = gr.Markdown(label="summary")
                with gr.Row():
                    maps = [gr.Plot(label="with the capsule"), gr.Plot(label="without (the sink)"),
                            gr.Plot(label="with the soft prompt")]
                with gr.Row():
                    maps += [gr.Plot(label="anchor mass: layers × heads"), gr.Plot(label="sink mass: layers × heads"),
                             gr.Plot(label="soft-prompt mass: layers × heads")]
                maps.append(gr.Plot(label="per layer"))
                with gr.Accordion("Training-free probe: prepend k mean-pooled instance tokens", open=False):
                    gr.Markdown("The paper's experiment: the chosen capsule as trained, with k mean-pooled tokens of "
                                "the input's own hidden states prepended at every capsule layer, nothing trained; "
                                "accuracy on a fixed random sample of the task's val split.")
                    with gr.Row():
                        probe_ks = gr.CheckboxGroup(list(PAPER_KS), value=list(PAPER_KS), label="k")
                        probe_n = gr.Slider(8, 200, value=32, step=8, label="val examples")
                        probe_btn = gr.Button("Run the probe")
                    probe_fig, probe_md = gr.Plot(label="accuracy per k"), gr.Markdown()
            with gr.Tab("Train") as tab_train:
                with gr.Row():
                    t = dict(backbone=gr.Dropdown(BACKBONES, value=DEFAULT, label="Backbone", allow_custom_value=True),
                             method=gr.Dropdown([(v, k) for k, v in TRAIN_METHODS.items()], value="capt",
                                                label="Method", info="a baseline on the same data: compare below"),
                             source=gr.Radio(["built-in task", OWN_FILE, OWN_TEXT], value="built-in task",
                                             label="Data", info="a task's labels, or free text for generation"),
                             task=gr.Dropdown(list(capt.TASKS), value="cb", label="Task"),
                             hub_dataset=gr.Textbox("", label="…its data from a Hub dataset id (optional)",
                                                    placeholder="aps/super_glue",
                                                    info="needs the Hub; empty: the local SuperGLUE files"),
                             preset=gr.Radio(list(PRESETS), value="quick: 20 steps", label="Preset"))
                with gr.Row(visible=False) as file_row:
                    t.update(data_file=gr.File(label="CSV / JSONL / JSON", file_types=[".csv", ".jsonl", ".json"]),
                             task_name=gr.Textbox(label="task name", value="custom"),
                             columns=gr.Textbox("", label="input column(s)", placeholder="text · a, b · review=text"),
                             label_column=gr.Textbox(label="label column", value="label"),
                             label_words=gr.Textbox("", label="label words", placeholder="pos=good, neg=bad"),
                             prompt_column=gr.Textbox("prompt", label="prompt column", visible=False,
                                                      info="what the capsule reads"),
                             completion_column=gr.Textbox("completion", label="completion column", visible=False,
                                                          info="what it learns to write after the prompt"))
                with gr.Accordion("Advanced", open=False), gr.Row():
                    t.update(lr=gr.Number(0, label="learning rate (0: the method's default)"),
                             seed=gr.Number(0, precision=0, label="seed"),
                             max_steps=gr.Number(0, precision=0, label="max steps (0: the preset's)"),
                             batch_size=gr.Number(8, precision=0, label="batch size"),
                             fusion=gr.Dropdown(list(FUSIONS), value="add", label="fusion"),
                             placement=gr.Dropdown(list(PLACEMENTS), value="slot", label="placement"),
                             layers=gr.Dropdown(list(LAYER_PRESETS), value="all", label="layers (or 0, 2, 5)",
                                                allow_custom_value=True),
                             head=gr.Dropdown(list(HEADS), value="verbalizer", label="head"))
                with gr.Row():
                    train_btn, stop_btn = gr.Button("Train", variant="primary"), gr.Button("Stop", variant="stop")
                progress, t_err = gr.Markdown(label="progress"), gr.Markdown(label="training error")
                with gr.Row():
                    curves = [gr.Plot(label="loss"), gr.Plot(label="dev")]
                download = gr.File(label="the new capsule (.zip)", interactive=False)
                with gr.Accordion("Push the latest trained capsule to the Hugging Face Hub", open=False), gr.Row():
                    hub_repo = gr.Textbox(label="repo id", placeholder="your-name/capt-cb")
                    hub_token = gr.Textbox(label="write token (used once, not stored)", type="password")
                    hub_private = gr.Checkbox(True, label="private")
                    push_btn = gr.Button("Push")
                push_md = gr.Markdown()
                runs_md = gr.Markdown()
            with gr.Tab("API") as tab_api:
                gr.Markdown(API_DOC)
        err = gr.Markdown(label="error")

        private = dict(api_visibility="private")
        common = dict(backbone=backbone, hub_id=hub_id, capsule=capsule, task=task, session=session, picked=picked,
                      **boxes, custom_fields=custom)
        predict_btn.click(warned(predict_view), inputs_kwargs=common, outputs=[probs, report, err], api_name="predict")
        gen_btn.click(warned(generate_view), inputs_kwargs={**common, "max_new_tokens": gen_tokens,
                                                            "own_prompt": own_prompt},
                      outputs=[gen_md, err], api_name="generate")
        gr.on([attn_btn.click, layer.release, head.release], warned(attention_view), api_name="attention",
              inputs_kwargs={**common, "layer": layer, "head": head, "soft_prompt": soft},
              outputs=[*maps, attn_md, err]).then(slider_ranges, [backbone, hub_id], [layer, head], **private)
        probe_btn.click(warned(probe_view), api_name="probe", outputs=[probe_fig, probe_md, err],
                        inputs_kwargs=dict(backbone=backbone, hub_id=hub_id, capsule=capsule, task=task,
                                           session=session, n_examples=probe_n, ks=probe_ks))
        train_btn.click(on_train, inputs_kwargs={**t, "session": session}, api_name="train",
                        concurrency_limit=1, concurrency_id="train",
                        outputs=[*curves, progress, t_err, download, session, backbone, hub_id, capsule, task, custom,
                                 gen_box, note, runs_md, soft])
        push_btn.click(push_capsule, [hub_repo, hub_token, session, hub_private], push_md, **private)
        stop_btn.click(on_stop, outputs=t_err, api_name="stop", concurrency_limit=None)
        gr.on([backbone.input, hub_id.submit], refresh, [backbone, hub_id, capsule, soft, session], [capsule, soft],
              **private)
        on_pick = dict(fn=lambda c, s, n: chosen(task_choice(c, s), clear=n == FREE_TEXT_NOTE),
                       inputs=[capsule, session, note], outputs=[task, custom, gen_box, note], **private)
        capsule.input(**on_pick)
        task.change(lambda v: [gr.update(visible=x) for x in visible_fields(v)], task, [*boxes.values(), custom],
                    **private)
        example_event = example_btn.click(on_example, task, [*boxes.values(), note, picked], **private)
        zip_up.upload(on_upload, [zip_up, backbone, hub_id, session], [session, capsule, err], **private).then(
            **on_pick)   # an uploaded capsule is chosen as if picked: its task too
        labelled, text = [t[k] for k in ("task_name", "columns", "label_column", "label_words")], [
            t["prompt_column"], t["completion_column"]]
        t["source"].change(lambda s: (gr.update(visible=s != "built-in task"),
                                      *[gr.update(visible=s == "built-in task")] * 2,
                                      *[gr.update(visible=s == OWN_FILE)] * len(labelled),
                                      *[gr.update(visible=s == OWN_TEXT)] * len(text)),
                           t["source"], [file_row, t["task"], t["hub_dataset"], *labelled, *text], **private)
        for tab, show in ((tab_predict, True), (tab_attn, True), (tab_train, False), (tab_api, False)):
            tab.select(lambda show=show, tab=tab: (gr.update(visible=show), tab is tab_attn), None,
                       [inputs_col, on_attention_tab], **private)

        def live_attention(active, **kw):   # the Attention view follows the input while it is on screen
            return warned(attention_view)(**kw) if active else [gr.skip()] * (len(maps) + 2)
        live = dict(inputs_kwargs={**common, "layer": layer, "head": head, "soft_prompt": soft,
                                   "active": on_attention_tab}, outputs=[*maps, attn_md, err], **private)
        gr.on([b.blur for b in (*boxes.values(), custom)], live_attention, trigger_mode="always_last", **live)
        example_event.then(live_attention, **live)
        demo.unload(on_close)
    # at most CAPT_APP_QUEUE jobs wait ("queue full" beyond), each seeing its position; one training at a time
    return demo.queue(default_concurrency_limit=int(os.environ.get("CAPT_APP_CONCURRENCY", 4)),
                      max_size=int(os.environ.get("CAPT_APP_QUEUE", 32)))


if __name__ == "__main__":
    threading.Thread(target=get_backbone, args=(DEFAULT,), daemon=True).start()   # warm the default backbone
    # uploads (a capsule zip, a CSV/JSONL) over the limit are refused by Gradio with a message, before any handler
    build_demo().launch(theme="soft", max_file_size=os.environ.get("CAPT_APP_MAX_UPLOAD", "50mb"))
