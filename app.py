"""CaPT Playground: predict with a capsule, see its attention anchor, train one. `python app.py` serves it offline.

Handlers are plain functions calling `capt` (no Gradio inside); `build_demo()` only lays out and wires them."""
import json, os, queue, random, shutil, sys, tempfile, threading, time, traceback, uuid, zipfile  # noqa: E401
from pathlib import Path

import capt
from capt import CaptError, viz
from capt.config import FUSIONS, HEADS, LAYER_PRESETS, PLACEMENTS
from capt.io import read_config
from capt.training import TrainConfig, prepare_data, train

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
HINTS = {"question": "COPA: cause or effect", "word": "WiC: the word both sentences share"}
_MODELS: dict[str, capt.Backbone] = {}      # read-only once loaded: capsules attach per call
_LOADING: dict[str, threading.Lock] = {}    # one lock per name, so each backbone loads once
_LOCK = threading.Lock()
_STOPS: dict[str, threading.Event] = {}     # session id -> the stop flag of the training it runs


def norm_backbone(name: str) -> str:
    key = (name or "").strip()
    return key.lower() if key.lower() in capt.EMBEDDED + capt.TINY else capt.HUB_ALIASES.get(key.lower(), key)


def get_backbone(name: str) -> capt.Backbone:
    key = norm_backbone(name)
    if not key:
        raise CaptError("choose a backbone or type a hub id")
    with _LOCK:
        loading = _LOADING.setdefault(key, threading.Lock())
    with loading:   # other names keep loading and running meanwhile
        if key not in _MODELS:
            _MODELS[key] = capt.load_backbone(key)
    return _MODELS[key]


def message(e: Exception) -> str:
    """What the user sees of an error: capt's own message; a traceback only goes to the server log."""
    if isinstance(e, CaptError):
        return str(e)
    traceback.print_exc(file=sys.stderr)
    return f"Unexpected error ({type(e).__name__}): {e}"


def session_dir(session: dict) -> Path:
    session["dir"] = session.get("dir") or str(WORK_DIR / uuid.uuid4().hex)
    Path(session["dir"]).mkdir(parents=True, exist_ok=True)
    return Path(session["dir"])


def drop_session(session: dict | None) -> None:
    if session and session.get("dir"):
        shutil.rmtree(session["dir"], ignore_errors=True)


# --- capsules ------------------------------------------------------------------------------------------
def capsule_choices(backbone: str, session: dict | None) -> list[tuple[str, str]]:
    """(label, value): zero-shot, this backbone's shipped capsules, this session's trained or uploaded ones."""
    key, out = norm_backbone(backbone), [("none (zero-shot)", NONE)]
    if key and "/" not in key:
        out += [(f"shipped: {c.parent.name}", str(c.parent)) for c in sorted((SHIPPED / key).glob("*/capsule.json"))]
    return out + [(c["label"], c["path"]) for c in (session or {}).get("capsules", []) if c["backbone"] == key]


def resolve(backbone: str, capsule: str, task: str, session: dict | None):
    """(backbone, capsule or None, task, notes); only shipped capsules and the session's own are read."""
    bb, cap, cap_task, notes = get_backbone(backbone), None, None, []
    if capsule and capsule != NONE:
        if capsule not in {str(p.parent) for p in SHIPPED.glob("*/*/capsule.json")} | {
                c["path"] for c in (session or {}).get("capsules", [])}:
            raise CaptError(f"unknown capsule {capsule!r}: choose one from the list, or train or upload one first")
        cap, cap_task = capt.load_capsule(capsule, bb)
    if task == CUSTOM and (cap_task is None or cap_task.name in capt.TASKS):
        raise CaptError("the 'custom' task needs a capsule trained on your own data; select one")
    t = cap_task if task == CUSTOM else capt.get_task(task)
    if cap_task is not None and cap_task.name != t.name:
        if cap.head is not None and cap.head.out_features != len(t.labels):
            raise CaptError(f"this capsule's linear head has {cap.head.out_features} labels and {t.name} has "
                            f"{len(t.labels)}: choose task '{cap_task.name}'")
        notes.append(f"this capsule was trained on '{cap_task.name}', not '{t.name}'")
    return bb, cap, t, notes


def capsule_task(value: str) -> tuple[str | None, str]:
    """A capsule's task: a built-in name, or CUSTOM and a JSON template of its fields."""
    info = read_config(value).get("task") if value and value != NONE else None
    if not info:
        return None, ""
    if info["name"] in capt.TASKS and list(capt.TASKS[info["name"]].labels) == list(info["labels"]):
        return info["name"], ""
    return CUSTOM, json.dumps({f: "" for f in info["fields"]})


def upload_capsule(zip_path: str | None, backbone: str, session: dict) -> tuple[dict, str | None, str]:
    """Unpack an uploaded capsule .zip into the session: (session, value to select or None, message)."""
    try:
        if not str(zip_path or "").lower().endswith(".zip"):
            raise CaptError(f"{Path(zip_path or 'nothing').name} is not a .zip: upload a zipped capsule folder "
                            "(capsule.json + capsule.safetensors)")
        dest = session_dir(session) / "uploads" / uuid.uuid4().hex[:8]
        with zipfile.ZipFile(zip_path) as z:
            if any(n.startswith("/") or ".." in Path(n).parts for n in z.namelist()):
                raise CaptError("the zip holds unsafe paths (absolute or '..'); refusing it")
            if sum(i.file_size for i in z.infolist()) > 500 * 2 ** 20:
                raise CaptError("the zip unpacks to more than 500 MB; a capsule is a few hundred KB")
            z.extractall(dest)
        found = sorted(dest.rglob("capsule.json"), key=lambda p: len(p.parts))
        if not found:
            raise CaptError("the zip holds no capsule.json: zip the capsule folder itself")
        folder, info = found[0].parent, read_config(found[0].parent)
        capt.load_capsule(folder)   # format and tensor shapes are checked now, the backbone at use
        owner, task = info["backbone"]["name"], (info.get("task") or {}).get("name", "no task")
        session["capsules"].append({"label": f"uploaded: {Path(zip_path).stem} ({task})", "path": str(folder),
                                    "backbone": owner})
        if owner != norm_backbone(backbone):
            return session, None, (f"This capsule was trained for backbone '{owner}', not '{backbone}'. It is kept in "
                                   f"this session's list for '{owner}': select that backbone to use it.")
        return session, str(folder), ""
    except zipfile.BadZipFile:
        return session, None, f"{Path(zip_path).name} is not a valid zip file"
    except Exception as e:
        return session, None, message(e)


# --- inputs -------------------------------------------------------------------------------------------
def make_example(task: capt.Task, fields: dict) -> dict:
    """The task's example from the form: the FIELDS boxes, or for a custom task the JSON box 'custom_fields'."""
    if task.name in capt.TASKS:
        return {f: fields.get(f) or "" for f in task.fields}
    try:
        values = json.loads(fields.get("custom_fields") or "{}")
        return {f: values.get(f) for f in task.fields}
    except (json.JSONDecodeError, AttributeError) as e:
        raise CaptError(f"the custom fields must be a JSON object like {{\"text\": \"...\"}} ({e})") from None


def example_from_val(task: str, seed: int | None = None) -> tuple[dict, str]:
    """A random labelled val example as form fields, and a note with its gold label."""
    t = capt.get_task(task)
    ex = random.Random(seed).choice(capt.load_examples(t, "val"))
    gold = t.labels[ex["label"]] if ex.get("label") is not None else "unlabelled"
    return {f: ex[f] for f in t.fields}, f"{t.name} val example idx {ex['idx']} · gold label: **{gold}**"


def visible_fields(task: str) -> list[bool]:
    """Which boxes a task uses: the FIELDS order, then the custom JSON box."""
    used = set(capt.get_task(task).fields) if task != CUSTOM else set()
    return [f in used for f in FIELDS] + [task == CUSTOM]


# --- Predict and Attention -----------------------------------------------------------------------------
def predict_view(backbone: str, capsule: str = NONE, task: str = "rte", session: dict | None = None,
                 hub_id: str = "", **fields):
    """(probability figure, markdown report, error message) for one example, with and without the capsule."""
    try:
        bb, cap, t, notes = resolve(hub_id or backbone, capsule, task, session)
        example = make_example(t, fields)
        bare = capt.predict(bb, t, example)
        mine = capt.predict(bb, t, example, capsule=cap) if cap is not None else None
        fig = viz.probs_figure(list(t.labels), mine.probs if mine else None, bare.probs, title=f"{t.name} on {bb.name}")
        said = [f"{who}: **{p.label}** ({100 * p.probs[p.label]:.1f} %)"
                for who, p in (("with capsule", mine), ("without capsule", bare)) if p is not None]
        if bare.truncated:
            notes.append(f"the input was longer than the backbone's limit: {bare.dropped_tokens} tokens were cut")
        report = viz.capsule_markdown(cap, bb) if cap is not None else "No capsule: the bare backbone (zero-shot)."
        return fig, " · ".join(said) + "\n\n" + report + "".join(f"\n\n⚠ {n}" for n in notes), ""
    except Exception as e:
        return None, "", message(e)


def attention_view(backbone: str, capsule: str = NONE, task: str = "rte", layer: int = -1, head: int = -1,
                   session: dict | None = None, hub_id: str = "", **fields):
    """(maps with/without, anchor mass with/without, per layer, markdown, error); layer/head -1: the mean. With no
    capsule chosen, an untrained one (W = 0: the instance mean alone, a training-free pooled token) is the anchor."""
    try:
        (bb, cap, t, _), name = resolve(hub_id or backbone, capsule, task, session), "capsule"
        if cap is None:
            cap, name = capt.Capsule.for_backbone(bb, n_labels=len(t.labels)), "untrained capsule (W=0)"
        prompt = t.render(make_example(t, fields), bb.style).prompt
        with_r, without_r = capt.attention(bb, prompt, capsule=cap), capt.attention(bb, prompt)
        for what, v, n in (("layer", layer, with_r.maps.shape[0]), ("head", head, with_r.maps.shape[1])):
            if not -1 <= int(v) < n:
                raise CaptError(f"{what} {int(v)} does not exist: {bb.name} has {what}s 0..{n - 1} (-1 = mean)")
        figs, text = viz.attention_panel(with_r, without_r, None if int(layer) < 0 else int(layer),
                                         None if int(head) < 0 else int(head), name)
        return *figs, text, ""
    except Exception as e:
        return None, None, None, None, None, "", message(e)


# --- Train --------------------------------------------------------------------------------------------
def parse_label_words(text: str) -> dict:
    """'pos=good, neg=bad' (or one label=word per line) -> {"pos": "good", "neg": "bad"}."""
    pairs = [p.partition("=") for p in (text or "").replace("\n", ",").split(",") if p.strip()]
    bad = [raw + sep + word for raw, sep, word in pairs if not (sep and raw.strip() and word.strip())]
    if bad or len(pairs) < 2:
        raise CaptError(f"label words: give label=word pairs, at least two, e.g. pos=good, neg=bad (not {bad or text!r})")
    return {raw.strip(): word.strip() for raw, _, word in pairs}


def train_config(backbone: str, task: str, preset: str, out_dir: str, data_file: str | None = None,
                 columns: str = "", label_column: str = "label", label_words: str = "", lr: float | None = None,
                 max_steps: int | None = None, batch_size: int = 8, seed: int = 0, fusion: str = "add",
                 placement: str = "slot", layers: str = "all", head: str = "verbalizer") -> TrainConfig:
    """A validated TrainConfig: a built-in task, or the user's file (`task` names it) when data_file is set."""
    if preset not in PRESETS:
        raise CaptError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    spec = str(layers or "all").strip()
    try:
        spec = [int(x) for x in spec.replace(",", " ").split()] if spec[:1].isdigit() else spec
    except ValueError:
        raise CaptError(f"layers {spec!r}: a preset ({', '.join(LAYER_PRESETS)}) or indices like 0, 2, 5") from None
    cfg = {**PRESETS[preset], **({"max_steps": int(max_steps), "max_minutes": None} if max_steps else {})}
    cfg.update(backbone=norm_backbone(backbone), lr=float(lr) if lr else None, batch_size=int(batch_size),
               seed=int(seed), out_dir=out_dir, capsule=dict(fusion=fusion, placement=placement, layers=spec, head=head))
    if not data_file:
        return TrainConfig(task=capt.get_task(task).name, **cfg)
    pairs = [p.split("=", 1) if "=" in p else (p, p) for p in (columns or "").split(",") if p.strip()]
    if not pairs:
        raise CaptError("name the input column(s) of your file, e.g. 'text', 'premise, hypothesis' or 'review=text'")
    mapping = {f.strip(): c.strip() for f, c in pairs}
    return TrainConfig(task=(task or "").strip() or "custom", data_file=data_file, fields=list(mapping), columns=mapping,
                       label_column=(label_column or "label").strip(), label_words=parse_label_words(label_words), **cfg)


def stop_training(session_id: str) -> str:
    if session_id not in _STOPS:
        return "No training is running in this session."
    return _STOPS[session_id].set() or "Stopping after the current step; the best capsule so far is kept."


def train_run(backbone: str, task: str, preset: str, session: dict, session_id: str = "local", **options):
    """Generator of UI states while a worker thread trains (options: see train_config): dicts with the loss and
    dev figures, a progress line and the session; at the end the new capsule's path, its zip and task."""
    state = dict(loss=None, dev=None, progress="", session=session, capsule=None, zip=None, task=(None, ""), error="")
    try:
        out = session_dir(session) / f"run-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
        cfg = train_config(backbone, task, preset, str(out), **options)
        if session_id in _STOPS:
            raise CaptError("this session is already training; stop it first")
    except Exception as e:
        yield {**state, "error": message(e)}
        return
    events, stop, curves = queue.Queue(), threading.Event(), viz.TrainingCurves()
    _STOPS[session_id] = stop

    def work():
        try:
            events.put({"kind": "info", "text": "checking the data…"})
            prepare_data(cfg)   # a bad file fails here, before any backbone is loaded
            events.put({"kind": "info", "text": f"loading backbone {cfg.backbone}…"})
            bb = get_backbone(cfg.backbone)
            events.put({"kind": "info", "text": "training: the first step…"})
            events.put({"kind": "finished", "summary": train(cfg, bb, callback=events.put, stop=stop, progress=False)})
        except Exception as e:
            events.put({"kind": "error", "text": message(e)})

    done, last = False, 0.0
    try:
        threading.Thread(target=work, daemon=True, name=f"capt-train-{session_id}").start()
        while not done:
            try:
                batch = [events.get(timeout=0.25)]
                while not events.empty():
                    batch.append(events.get_nowait())
            except queue.Empty:
                batch = []
            for ev in batch:
                curves.add(ev)
                state["progress"] = ev["text"] if ev["kind"] == "info" else curves.text
                done = done or ev["kind"] in ("error", "finished")
                state.update(error=ev["text"]) if ev["kind"] == "error" else None
                state.update(_finish(ev["summary"], session)) if ev["kind"] == "finished" else None
            if done or (batch and time.time() - last > 0.5):
                last, (state["loss"], state["dev"]) = time.time(), curves.figures()
                yield dict(state)
    finally:
        stop.set()   # a no-op after the end; if the page went away, the worker ends within one step
        _STOPS.pop(session_id, None)


def _finish(summary: dict, session: dict) -> dict:
    path, key = Path(summary["artifact"]), summary["selection_metric"]
    session["capsules"].append({"label": f"trained: {summary['task']} · {summary['steps']} steps · test {key} "
                                f"{100 * summary['test'][key]:.1f} % · {time.strftime('%H:%M:%S')}",
                                "path": str(path), "backbone": summary["backbone"]})
    name = f"capsule-{summary['backbone'].replace('/', '_')}-{summary['task']}-{path.parent.name}"
    with zipfile.ZipFile(path.parent / f"{name}.zip", "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(path.iterdir()):
            z.write(f, f"{name}/{f.name}")
    return {"progress": viz.summary_markdown(summary) + " The capsule is now selected in Predict and Attention.",
            "capsule": str(path), "zip": str(path.parent / f"{name}.zip"), "task": capsule_task(str(path))}


# --- layout and wiring ---------------------------------------------------------------------------------
def build_demo():
    import gradio as gr

    def toast(msg: str) -> str:
        return gr.Warning(msg) or msg if msg else msg

    def warned(fn):     # a handler's last output is its error message: show it as a toast too
        return lambda **kw: (*(out := fn(**kw))[:-1], toast(out[-1]))

    def refresh(backbone, hub_id, capsule, session):
        choices = capsule_choices(hub_id or backbone, session)
        return gr.update(choices=choices, value=capsule if capsule in [v for _, v in choices] else NONE)

    def on_example(task):
        try:
            fields, note = example_from_val(task)
            return *[fields.get(f, gr.skip()) for f in FIELDS], note
        except Exception as e:
            return *[gr.skip()] * len(FIELDS), toast(message(e))

    def on_upload(zip_path, backbone, hub_id, session):
        session, value, err = upload_capsule(zip_path, hub_id or backbone, session)
        return session, gr.update(choices=capsule_choices(hub_id or backbone, session), value=value or NONE), toast(err)

    def on_train(request: gr.Request, source, task_name, data_file, session, **kw):
        own, bb = source == OWN_FILE, norm_backbone(kw["backbone"])
        kw.update(task=task_name if own else kw["task"], data_file=data_file if own else None)
        for s in train_run(session=session, session_id=request.session_hash or "api", **kw):
            picks = (bb if bb in BACKBONES else gr.skip(), "" if bb in BACKBONES else bb, gr.update(
                choices=capsule_choices(bb, s["session"]), value=s["capsule"]), s["task"][0] or gr.skip(),
                s["task"][1] or gr.skip()) if s["capsule"] else (gr.skip(),) * 5
            yield s["loss"], s["dev"], s["progress"], toast(s["error"]), s["zip"], s["session"], *picks

    def on_stop(request: gr.Request) -> str:
        return gr.Info(msg := stop_training(request.session_hash or "api")) or msg

    with gr.Blocks(title="CaPT Playground") as demo:
        session = gr.State({"dir": None, "capsules": []}, delete_callback=drop_session)
        gr.Markdown("# CaPT Playground\nCapsule Prompt-Tuning (NeurIPS 2025): one learnable vector per layer, fused with "
                    "the mean of the input's own hidden states and placed as one token at the earliest position, where "
                    "it becomes an *attention anchor*. Predict with a capsule, look at its attention, or train one here.")
        with gr.Column() as inputs_col:
            with gr.Row():
                backbone = gr.Dropdown(BACKBONES, value=DEFAULT, label="Backbone", info="embedded ones work offline; "
                                       "tiny-llama is a random 4-layer test model")
                hub_id = gr.Textbox(label="…or a hub id (Enter)", placeholder="Qwen/Qwen2.5-1.5B", info="needs the "
                                    "Hugging Face hub, often unreachable here; the embedded backbones always work")
                capsule = gr.Dropdown(capsule_choices(DEFAULT, None), value=NONE, label="Capsule", allow_custom_value=True,
                                      info="shipped, or trained / uploaded in this session")
                task = gr.Dropdown([*capt.TASKS, ("custom (the capsule's own task)", CUSTOM)], value="rte", label="Task")
            with gr.Row():
                boxes = {f: gr.Textbox(label=f, lines=4 if f in ("passage", "paragraph") else 1, visible=f in
                                       ("premise", "hypothesis"), info=HINTS.get(f)) for f in FIELDS}
                custom = gr.Textbox(label="fields of the capsule's task (JSON)", visible=False)
            boxes["premise"].value, boxes["hypothesis"].value = "The cat sat on the mat.", "A cat was sitting."
            with gr.Row():
                example_btn = gr.Button("Example from val", size="sm")
                zip_up = gr.UploadButton("Upload a capsule (.zip)", file_types=[".zip"], size="sm")
            note = gr.Markdown()
        with gr.Tabs():
            with gr.Tab("Predict") as tab_predict:
                predict_btn = gr.Button("Predict", variant="primary")
                probs, report = gr.Plot(label="label probabilities, with the capsule and without it"), gr.Markdown()
            with gr.Tab("Attention") as tab_attn:
                with gr.Row():
                    layer = gr.Slider(-1, 63, value=-1, step=1, label="layer (-1: mean over layers)")
                    head = gr.Slider(-1, 63, value=-1, step=1, label="head (-1: mean over heads)")
                    attn_btn = gr.Button("Show attention", variant="primary")
                attn_md = gr.Markdown()
                with gr.Row():
                    maps = [gr.Plot(label="with the capsule"), gr.Plot(label="without (the sink)")]
                with gr.Row():
                    maps += [gr.Plot(label="anchor mass: layers × heads"), gr.Plot(label="sink mass: layers × heads")]
                maps.append(gr.Plot(label="per layer"))
            with gr.Tab("Train") as tab_train:
                with gr.Row():
                    t = dict(backbone=gr.Dropdown(BACKBONES, value=DEFAULT, label="Backbone", allow_custom_value=True),
                             source=gr.Radio(["built-in task", OWN_FILE], value="built-in task", label="Data"),
                             task=gr.Dropdown(list(capt.TASKS), value="cb", label="Task"))
                with gr.Row(visible=False) as file_row:
                    t.update(data_file=gr.File(label="CSV / JSONL / JSON", file_types=[".csv", ".jsonl", ".json"]),
                             task_name=gr.Textbox(label="task name", value="custom"),
                             columns=gr.Textbox(label="input column(s)", placeholder="text · premise, hypothesis · review=text"),
                             label_column=gr.Textbox(label="label column", value="label"),
                             label_words=gr.Textbox(label="label words", placeholder="pos=good, neg=bad"))
                t["preset"] = gr.Radio(list(PRESETS), value="quick: 20 steps", label="Preset")
                with gr.Accordion("Advanced", open=False), gr.Row():
                    t.update(lr=gr.Number(0.03, label="learning rate"), seed=gr.Number(0, precision=0, label="seed"),
                             max_steps=gr.Number(0, precision=0, label="max steps (0: the preset's)"),
                             batch_size=gr.Number(8, precision=0, label="batch size"),
                             fusion=gr.Dropdown(list(FUSIONS), value="add", label="fusion"),
                             placement=gr.Dropdown(list(PLACEMENTS), value="slot", label="placement"),
                             layers=gr.Dropdown(list(LAYER_PRESETS), value="all", label="layers (or 0, 2, 5)",
                                                allow_custom_value=True),
                             head=gr.Dropdown(list(HEADS), value="verbalizer", label="head"))
                with gr.Row():
                    train_btn, stop_btn = gr.Button("Train", variant="primary"), gr.Button("Stop", variant="stop")
                progress, t_err = gr.Markdown(), gr.Markdown()
                with gr.Row():
                    curves = [gr.Plot(label="loss"), gr.Plot(label="dev")]
                download = gr.File(label="the new capsule (.zip)", interactive=False)
            with gr.Tab("API") as tab_api:
                gr.Markdown(API_DOC)
        err = gr.Markdown()

        private = dict(api_visibility="private")
        common = dict(backbone=backbone, hub_id=hub_id, capsule=capsule, task=task, session=session, **boxes,
                      custom_fields=custom)
        predict_btn.click(warned(predict_view), inputs_kwargs=common, outputs=[probs, report, err], api_name="predict")
        gr.on([attn_btn.click, layer.release, head.release], warned(attention_view), api_name="attention",
              inputs_kwargs={**common, "layer": layer, "head": head}, outputs=[*maps, attn_md, err])
        train_btn.click(on_train, inputs_kwargs={**t, "session": session}, api_name="train", concurrency_limit=1,
                        concurrency_id="train", outputs=[*curves, progress, t_err, download, session, backbone, hub_id,
                                                         capsule, task, custom])
        stop_btn.click(on_stop, outputs=t_err, api_name="stop", concurrency_limit=None)
        gr.on([backbone.input, hub_id.submit], refresh, [backbone, hub_id, capsule, session], capsule, **private)
        capsule.input(lambda c: [v or gr.skip() for v in capsule_task(c)], capsule, [task, custom], **private)
        task.change(lambda v: [gr.update(visible=x) for x in visible_fields(v)], task, [*boxes.values(), custom], **private)
        example_btn.click(on_example, task, [*boxes.values(), note], **private)
        zip_up.upload(on_upload, [zip_up, backbone, hub_id, session], [session, capsule, err], **private)
        t["source"].change(lambda s: (gr.update(visible=s == OWN_FILE), gr.update(visible=s != OWN_FILE)),
                           t["source"], [file_row, t["task"]], **private)
        for tab, show in ((tab_predict, True), (tab_attn, True), (tab_train, False), (tab_api, False)):
            tab.select(lambda show=show: gr.update(visible=show), None, inputs_col, **private)
    return demo.queue(default_concurrency_limit=int(os.environ.get("CAPT_APP_CONCURRENCY", 4)))


API_DOC = """Every action is an endpoint: `/predict`, `/attention`, `/train`, `/stop`. One `gradio_client.Client` is
one session, so the capsules it trains stay selectable for it:
```python
from gradio_client import Client
c = Client("http://127.0.0.1:7860/")
fig, report, error = c.predict(backbone="smollm2-135m", capsule="none", task="rte", premise="The cat sat.",
                               hypothesis="A cat was sitting.", api_name="/predict")
*figures, summary, error = c.predict(task="rte", premise="...", hypothesis="...", layer=-1, head=-1, api_name="/attention")
out = c.predict(backbone="smollm2-135m", task="cb", preset="quick: 20 steps", api_name="/train")
capsule = out[8]["value"]     # the new capsule: pass capsule=... to /predict or /attention from the same client
```"""

if __name__ == "__main__":
    import gradio as gr
    threading.Thread(target=get_backbone, args=(DEFAULT,), daemon=True).start()   # warm the default backbone
    build_demo().launch(theme=gr.themes.Soft())
