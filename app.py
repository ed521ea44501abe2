"""CaPT Playground: predict with a capsule, look at its attention anchor, train one in the browser.

`python app.py` serves it locally on the embedded SmolLM2-135M (no network needed). The handlers below
are plain functions (no Gradio inside) that call the `capt` library; `build_demo()` only lays out and
wires them. Backbones are frozen and shared read-only through a keyed cache; capsules attach per call.
"""
import json
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zipfile
from pathlib import Path

import capt
from capt import CaptError, viz
from capt.io import read_config
from capt.training import TrainConfig, prepare_data, primary_metric, train

ROOT = Path(__file__).resolve().parent
SHIPPED = ROOT / "capsules"
WORK_DIR = Path(os.environ.get("CAPT_APP_DIR", Path(tempfile.gettempdir()) / "capt-app"))
BACKBONES = ["smollm2-135m", "gemma3-270m", "tiny-llama"]
TASKS = list(capt.TASKS)
NONE = "none"                # capsule value for the bare backbone
CUSTOM = "custom"            # task value: the selected capsule's own (user-defined) task
FIELDS = ["premise", "hypothesis", "passage", "question", "paragraph", "answer", "sentence1", "sentence2",
          "word", "choice1", "choice2", "cause_or_effect"]   # COPA's "question" is cause_or_effect here
PRESETS = {
    "quick: 20 steps": dict(max_steps=20, eval_every=10, max_dev=64, max_test=128),
    "short: 5 minutes": dict(max_minutes=5, eval_every=25, max_dev=128, max_test=256),
    "long: 30 minutes": dict(max_minutes=30, eval_every=50, max_dev=256, max_test=512),
    "paper protocol (hours on CPU)": dict(eval_every=50),
}
HUB_NOTE = ("A hub id (e.g. `Qwen/Qwen2.5-1.5B`) overrides the list. Loading it needs the Hugging Face hub, "
            "which may be unreachable here: the embedded backbones always work offline.")

# --- shared, read-only backbones and per-session stop flags ---------------------------------------
_MODELS: dict[str, capt.Backbone] = {}
_LOADING: dict[str, threading.Lock] = {}
_LOCK = threading.Lock()
_STOPS: dict[str, threading.Event] = {}


def get_backbone(name: str) -> capt.Backbone:
    """One frozen backbone per name for the whole process; a per-name lock avoids double loads."""
    key = (name or "").strip()
    if not key:
        raise CaptError("choose a backbone or type a hub id")
    with _LOCK:
        if key in _MODELS:
            return _MODELS[key]
        loading = _LOADING.setdefault(key, threading.Lock())
    with loading:
        if key not in _MODELS:
            bb = capt.load_backbone(key)
            with _LOCK:
                _MODELS[key] = bb
    return _MODELS[key]


def message(e: Exception) -> str:
    """The user-facing text of an error: capt's own message, never a traceback."""
    if isinstance(e, CaptError):
        return str(e)
    traceback.print_exc(file=sys.stderr)
    return f"Unexpected error ({type(e).__name__}): {e}"


def new_session() -> dict:
    return {"dir": None, "capsules": []}   # plain data only: gr.State deep-copies it


def session_dir(session: dict) -> Path:
    if not session.get("dir"):
        session["dir"] = str(WORK_DIR / uuid.uuid4().hex)
    Path(session["dir"]).mkdir(parents=True, exist_ok=True)
    return Path(session["dir"])


def drop_session(session: dict | None) -> None:
    if session and session.get("dir"):
        shutil.rmtree(session["dir"], ignore_errors=True)


def backbone_name(choice: str, hub_id: str = "") -> str:
    return (hub_id or "").strip() or (choice or "").strip()


# --- capsules --------------------------------------------------------------------------------------
def capsule_choices(backbone: str, session: dict | None) -> list[tuple[str, str]]:
    """(label, value) pairs: zero-shot, shipped capsules of this backbone, this session's own."""
    out = [("none (zero-shot)", NONE)]
    if backbone and "/" not in backbone:
        for cfg in sorted((SHIPPED / backbone).glob("*/capsule.json")):
            out.append((f"shipped: {cfg.parent.name}", str(cfg.parent)))
    out += [(c["label"], c["path"]) for c in (session or {}).get("capsules", []) if c["backbone"] == backbone]
    return out


def resolve_capsule(value: str, bb: capt.Backbone, session: dict | None):
    """(capsule, its task) for a dropdown value; only shipped or this session's capsules are readable."""
    if not value or value == NONE:
        return None, None
    known = {str(p.parent) for p in SHIPPED.glob("*/*/capsule.json")}
    known |= {c["path"] for c in (session or {}).get("capsules", [])}
    if value not in known:
        raise CaptError(f"unknown capsule {value!r}: choose one from the list, or train or upload one first")
    return capt.load_capsule(value, bb)


def capsule_task(value: str) -> tuple[str | None, str]:
    """The task a capsule was trained on (a built-in name or CUSTOM) and a JSON template of its fields."""
    if not value or value == NONE:
        return None, ""
    info = read_config(value).get("task")
    if not info:
        return None, ""
    if info["name"] in capt.TASKS and list(capt.TASKS[info["name"]].labels) == list(info["labels"]):
        return info["name"], ""
    return CUSTOM, json.dumps({f: "" for f in info["fields"]}, indent=1)


def upload_capsule(zip_path: str | None, backbone: str, session: dict) -> tuple[dict, str | None, str]:
    """Unpack an uploaded capsule .zip into the session; returns (session, value to select, message)."""
    try:
        if not zip_path:
            raise CaptError("no file uploaded")
        if not str(zip_path).lower().endswith(".zip"):
            raise CaptError(f"{Path(zip_path).name} is not a .zip: upload a zipped capsule folder "
                            "(capsule.json + capsule.safetensors)")
        dest = session_dir(session) / "uploads" / uuid.uuid4().hex[:8]
        try:
            with zipfile.ZipFile(zip_path) as z:
                names = z.namelist()
                if any(n.startswith("/") or ".." in Path(n).parts for n in names):
                    raise CaptError("the zip holds unsafe paths (absolute or '..'); refusing it")
                if sum(i.file_size for i in z.infolist()) > 500 * 2 ** 20:
                    raise CaptError("the zip unpacks to more than 500 MB; a capsule is a few hundred KB")
                z.extractall(dest)
        except zipfile.BadZipFile:
            raise CaptError(f"{Path(zip_path).name} is not a valid zip file") from None
        found = sorted(dest.rglob("capsule.json"), key=lambda p: len(p.parts))
        if not found:
            raise CaptError("the zip holds no capsule.json: zip the capsule folder itself")
        folder = found[0].parent
        capt.load_capsule(folder)   # format and tensor shapes are checked here, backbone at use
        info = read_config(folder)
        owner, task = info["backbone"]["name"], (info.get("task") or {}).get("name", "no task")
        session["capsules"].append({"label": f"uploaded: {Path(zip_path).stem} ({task})", "path": str(folder),
                                    "backbone": owner})
        if owner != backbone:
            return session, None, (f"This capsule was trained for backbone '{owner}', not '{backbone}'. It is kept "
                                   f"in this session's list for '{owner}': select that backbone to use it.")
        return session, str(folder), f"Loaded capsule for '{owner}' ({task})."
    except Exception as e:
        return session, None, message(e)


# --- inputs ----------------------------------------------------------------------------------------
def resolve_task(task: str, capsule_task_obj) -> capt.Task:
    if task == CUSTOM:
        if capsule_task_obj is None or capsule_task_obj.name in capt.TASKS:
            raise CaptError("the 'custom' task needs a capsule trained on your own data; select one")
        return capsule_task_obj
    return capt.get_task(task)


def make_example(task: capt.Task, fields: dict) -> dict:
    """The task's example from the form's fields (custom tasks: the JSON box 'custom_fields')."""
    if task.name not in capt.TASKS:
        try:
            values = json.loads(fields.get("custom_fields") or "{}")
        except json.JSONDecodeError as e:
            raise CaptError(f"the custom fields are not valid JSON ({e}); e.g. {{\"text\": \"...\"}}") from None
        if not isinstance(values, dict):
            raise CaptError("the custom fields must be a JSON object of field: text")
        return {f: values.get(f) for f in task.fields}
    key = {"question": "cause_or_effect"} if task.name == "copa" else {}
    return {f: (fields.get(key.get(f, f)) or "") for f in task.fields}


def example_from_val(task: str, seed: int | None = None) -> tuple[dict, str]:
    """A random labelled example of the task's val split, as form fields, and a note with its gold label."""
    t = capt.get_task(task)
    rows = capt.load_examples(t, "val")
    ex = random.Random(seed).choice(rows)
    fields = {("cause_or_effect" if (t.name == "copa" and f == "question") else f): ex[f] for f in t.fields}
    gold = t.labels[ex["label"]] if ex.get("label") is not None else "unlabelled"
    return fields, f"{t.name} val example idx {ex['idx']} · gold label: **{gold}**"


def visible_fields(task: str) -> list[bool]:
    """Which form boxes a task uses (FIELDS order, then the custom JSON box)."""
    if task == CUSTOM:
        return [False] * len(FIELDS) + [True]
    t = capt.get_task(task)
    used = {("cause_or_effect" if (t.name == "copa" and f == "question") else f) for f in t.fields}
    return [f in used for f in FIELDS] + [False]


def _capsule_md(capsule, bb, task, notes: list[str]) -> str:
    rep = capsule.param_report(bb)
    cfg = capsule.config
    lines = ["| parameters | count |", "|---|---:|", f"| capsule (W + fusion extras) | {rep['capsule']:,} |",
             f"| task head | {rep['head']:,} |", f"| backbone (frozen) | {rep['backbone']:,} |",
             f"| capsule share of backbone | {rep['share_percent']:.4f} % |",
             f"\nOptions: fusion `{cfg.fusion}` · placement `{cfg.placement}` · layers `{cfg.layers}` · "
             f"head `{cfg.head}` · {len(capsule.layer_ids)} of {bb.n_layers} layers × d={bb.hidden_size}"]
    training, metrics = capsule.meta.get("training") or {}, capsule.meta.get("metrics") or {}
    if training:
        scores = ", ".join(f"{k} {100 * v:.1f} %" for k, v in metrics.items())
        lines.append(f"\nTrained on `{training.get('task')}` for {training.get('steps')} steps "
                     f"({training.get('stopped_by')}); test: {scores or 'n/a'}")
    return "\n".join(lines + [f"\n⚠ {n}" for n in notes])


# --- Predict and Attention -------------------------------------------------------------------------
def predict_view(backbone: str, capsule: str, task: str, fields: dict, session: dict | None = None):
    """(probability figure, markdown report, error message) for one example, with and without the capsule."""
    try:
        bb = get_backbone(backbone)
        cap, cap_task = resolve_capsule(capsule, bb, session)
        t = resolve_task(task, cap_task)
        notes = []
        if cap_task is not None and cap_task.name != t.name:
            if cap.head is not None and cap.head.out_features != len(t.labels):
                raise CaptError(f"this capsule's linear head has {cap.head.out_features} labels; {t.name} has "
                                f"{len(t.labels)}: choose task '{cap_task.name}'")
            notes.append(f"this capsule was trained on '{cap_task.name}', not '{t.name}'")
        example = make_example(t, fields)
        bare = capt.predict(bb, t, example)
        mine = capt.predict(bb, t, example, capsule=cap) if cap is not None else None
        name = "capsule" if cap is not None else ""
        fig = viz.probs_figure(list(t.labels), mine.probs if mine else None, bare.probs, capsule_name=name,
                               title=f"{t.name} on {bb.name}")
        said = [f"without capsule: **{bare.label}** ({100 * bare.probs[bare.label]:.1f} %)"]
        if mine:
            said.insert(0, f"with capsule: **{mine.label}** ({100 * mine.probs[mine.label]:.1f} %)")
        if bare.truncated:
            notes.append(f"the input was longer than the backbone's limit: {bare.dropped_tokens} tokens were cut")
        md = " · ".join(said) + "\n\n"
        md += _capsule_md(cap, bb, t, notes) if cap is not None else "No capsule: the bare backbone (zero-shot)."
        return fig, md, ""
    except Exception as e:
        return None, "", message(e)


def attention_view(backbone: str, capsule: str, task: str, fields: dict, layer: int = -1, head: int = -1,
                   session: dict | None = None):
    """(figures: with/without maps, with/without anchor mass, per layer; markdown; error message).
    layer/head -1 mean "average over all". Without a chosen capsule an untrained one (W = 0: the instance
    mean alone, the paper's training-free pooled token) shows the anchor."""
    try:
        bb = get_backbone(backbone)
        cap, cap_task = resolve_capsule(capsule, bb, session)
        t = resolve_task(task, cap_task)
        name = "capsule"
        if cap is None:
            cap, name = capt.Capsule.for_backbone(bb, n_labels=len(t.labels)), "untrained capsule (W=0)"
        prompt = t.render(make_example(t, fields), bb.style).prompt
        with_r, without_r = capt.attention(bb, prompt, capsule=cap), capt.attention(bb, prompt)
        n_layers, n_heads = with_r.maps.shape[:2]
        for what, v, n in (("layer", layer, n_layers), ("head", head, n_heads)):
            if not -1 <= int(v) < n:
                raise CaptError(f"{what} {int(v)} does not exist: {bb.name} has {what}s 0..{n - 1} (-1 = mean)")
        lay, hd = (None if int(layer) < 0 else int(layer)), (None if int(head) < 0 else int(head))
        zmax = viz.shared_max(with_r.mean_map(lay, hd)[1:, 1:], without_r.mean_map(lay, hd)[1:, 1:])
        mmax = viz.shared_max(with_r.anchor_mass(), without_r.anchor_mass())
        figs = (viz.attention_figure(with_r, lay, hd, f"with {name}", zmax=max(zmax, 1e-6)),
                viz.attention_figure(without_r, lay, hd, "without capsule", zmax=max(zmax, 1e-6)),
                viz.anchor_mass_figure(with_r, "with " + name, zmax=mmax),
                viz.anchor_mass_figure(without_r, "without capsule", zmax=mmax),
                viz.anchor_by_layer_figure(with_r, without_r, name))
        md = (f"{len(with_r.tokens)} positions with the {name} ({len(without_r.tokens)} without) · {n_layers} layers "
              f"× {n_heads} heads. Mean attention the other tokens pay to position 0: **{with_r.anchor_mass().mean():.3f}**"
              f" to the {name} vs **{without_r.anchor_mass().mean():.3f}** to the {without_r.anchor_label} "
              "without it. Colour ranges are shared between the two sides.")
        if with_r.truncated:
            md += "\n\n⚠ the input was cut to the backbone's limit."
        return figs, md, ""
    except Exception as e:
        return (None,) * 5, "", message(e)


# --- Train ---------------------------------------------------------------------------------------
def parse_label_words(text: str) -> dict:
    """'pos=good, neg=bad' or one 'label=word' per line -> {"pos": "good", "neg": "bad"}."""
    words = {}
    for part in (text or "").replace("\n", ",").split(","):
        if part.strip():
            raw, sep, word = part.partition("=") if "=" in part else part.partition(":")
            if not sep or not raw.strip() or not word.strip():
                raise CaptError(f"label words: {part.strip()!r} is not label=word (e.g. pos=good, neg=bad)")
            words[raw.strip()] = word.strip()
    if len(words) < 2:
        raise CaptError("give at least two label words, e.g. pos=good, neg=bad")
    return words


def file_columns(path: str | None) -> str:
    """The columns of an uploaded CSV/JSONL (its header or first record), for the mapping boxes."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        if path.lower().endswith(".csv"):
            import csv
            return "Columns: " + ", ".join(next(csv.reader([first])))
        if path.lower().endswith((".jsonl", ".json")):
            return "Columns: " + ", ".join(json.loads(first.strip().lstrip("[").rstrip(",")))
        return f"⚠ {Path(path).name}: use a .csv, .jsonl or .json file"
    except Exception as e:
        return f"⚠ could not read the columns of {Path(path).name}: {e}"


def train_config(backbone: str, task: str, data_file: str | None, columns: str, label_column: str,
                 label_words: str, preset: str, lr: float | None, max_steps: int | None, batch_size: int,
                 seed: int, fusion: str, placement: str, layers: str, head: str, out_dir: str) -> TrainConfig:
    """A validated TrainConfig from the Train tab (a built-in task, or a user file when data_file is set)."""
    if preset not in PRESETS:
        raise CaptError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    opts = dict(PRESETS[preset])
    if max_steps:
        opts.update(max_steps=int(max_steps), max_minutes=None)
    spec = (layers or "all").strip()
    layer_spec = [int(x) for x in spec.replace(",", " ").split()] if spec[:1].isdigit() else spec
    cfg = dict(backbone=backbone, lr=float(lr) if lr else None, batch_size=int(batch_size), seed=int(seed),
               capsule=dict(fusion=fusion, placement=placement, layers=layer_spec, head=head), out_dir=out_dir, **opts)
    if data_file:
        pairs = [c.strip() for c in (columns or "").split(",") if c.strip()]
        if not pairs:
            raise CaptError("name the input column(s) of your file, e.g. 'text' or 'premise, hypothesis'")
        mapping = dict((p.split("=", 1) if "=" in p else (p, p)) for p in pairs)
        mapping = {k.strip(): v.strip() for k, v in mapping.items()}
        cfg.update(task=(task or "custom").strip() or "custom", data_file=data_file, fields=list(mapping),
                   columns=mapping, label_column=(label_column or "label").strip(),
                   label_words=parse_label_words(label_words))
    else:
        cfg["task"] = capt.get_task(task).name
    return TrainConfig(**cfg)


def stop_training(session_id: str) -> str:
    event = _STOPS.get(session_id)
    if event is None:
        return "No training is running in this session."
    event.set()
    return "Stopping after the current step; the best capsule so far is kept."


def _eta(seconds: float | None) -> str:
    s = int(seconds or 0)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def train_run(backbone: str, task: str, data_file: str | None, columns: str, label_column: str, label_words: str,
              preset: str, lr: float | None, max_steps: int | None, batch_size: int, seed: int, fusion: str,
              placement: str, layers: str, head: str, session: dict, session_id: str = "local"):
    """Generator of UI states while a worker thread trains: dicts with loss/dev figures, progress text,
    the session, and at the end the new capsule's path and zip (or an error message)."""
    state = {"loss": None, "dev": None, "progress": "", "session": session, "capsule": None, "zip": None,
             "error": ""}
    try:
        run_dir = session_dir(session) / f"run-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
        cfg = train_config(backbone, task, data_file, columns, label_column, label_words, preset, lr, max_steps,
                           batch_size, seed, fusion, placement, layers, head, str(run_dir))
    except Exception as e:
        yield {**state, "error": message(e)}
        return
    events, stop = queue.Queue(), threading.Event()
    _STOPS[session_id] = stop

    def work():
        try:
            events.put({"kind": "info", "text": "checking the data…"})
            prepare_data(cfg)   # bad files fail here, before a backbone is loaded
            events.put({"kind": "info", "text": f"loading backbone {cfg.backbone}…"})
            bb = get_backbone(cfg.backbone)
            events.put({"kind": "info", "text": "training…"})
            events.put({"kind": "finished", "summary": train(cfg, bb, callback=events.put, stop=stop, progress=False)})
        except Exception as e:
            events.put({"kind": "error", "text": message(e)})

    worker = threading.Thread(target=work, daemon=True, name=f"capt-train-{session_id}")
    steps, losses, evals, metric, last, done = [], [], [], "accuracy", 0.0, False
    try:
        worker.start()
        while not done:
            try:
                ev = events.get(timeout=0.25)
            except queue.Empty:
                ev = None
            while ev is not None:
                kind = ev["kind"]
                if kind == "info":
                    state["progress"] = ev["text"]
                elif kind == "step":
                    steps.append(ev["step"]), losses.append(ev["loss"])
                    best = f" · best dev {100 * ev['best']:.1f} %" if ev.get("best") is not None else ""
                    state["progress"] = (f"step {ev['step']}/{ev['total_steps']} · loss {ev['loss']:.4f} · "
                                         f"{ev['examples_per_s']:.1f} examples/s · ETA {_eta(ev['eta_s'])}{best}")
                elif kind == "eval":
                    evals.append(ev)
                    metric = "f1a" if "f1a" in ev["dev"] else "accuracy"
                elif kind == "error":
                    state["error"], done = ev["text"], True
                elif kind == "finished":
                    s, done = ev["summary"], True
                    metric = s["selection_metric"]
                    state.update(_finish(s, cfg, session))
                ev = events.get_nowait() if not events.empty() else None
            state["loss"] = viz.loss_figure(steps, losses) if steps else None
            state["dev"] = viz.dev_figure(evals, metric) if evals else None
            if done or time.time() - last > 0.5:
                last = time.time()
                yield dict(state)
    finally:
        if not done:
            stop.set()   # the page went away: end the worker within one step
        if _STOPS.get(session_id) is stop:
            del _STOPS[session_id]


def _finish(summary: dict, cfg: TrainConfig, session: dict) -> dict:
    path = Path(summary["artifact"])
    key = summary["selection_metric"]
    test = summary["test"].get(key, 0.0)
    label = (f"trained: {summary['task']} · {summary['steps']} steps · test {key} {100 * test:.1f} % · "
             f"{time.strftime('%H:%M:%S')}")
    session["capsules"].append({"label": label, "path": str(path), "backbone": summary["backbone"]})
    name = f"capsule-{summary['backbone'].replace('/', '_')}-{summary['task']}-{path.parent.name}"
    zip_path = path.parent / f"{name}.zip"
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(path.iterdir()):
            z.write(f, f"{name}/{f.name}")
    scores = " · ".join(f"{k} {100 * v:.1f} %" for k, v in summary["test"].items())
    progress = (f"**Done** ({summary['stopped_by']}): {summary['steps']} steps in {summary['train_seconds']:.0f} s, "
                f"best at step {summary['best_step']}. Test ({summary['n_test']} examples): {scores}. "
                f"{summary['n_trainable']:,} trainable parameters "
                f"({100 * summary['n_trainable'] / summary['backbone_params']:.4f} % of the backbone). "
                f"Data: {summary['data']}. The capsule is now selectable in Predict and Attention.")
    return {"progress": progress, "session": session, "capsule": str(path), "zip": str(zip_path)}
