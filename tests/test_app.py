"""The Gradio app: its handlers as plain functions, then a gradio_client round-trip against the launched app.

Offline and on the tiny random backbone only (tiny-llama: 4 layers, d=32), so the whole file runs in well
under a minute; SmolLM2 is never loaded here.
"""
import csv
import json
import os
import re
import zipfile

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no telemetry or version checks
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

import app  # noqa: E402
import fake_zerogpu  # noqa: E402
import capt  # noqa: E402

BB = "tiny-llama"
CB = dict(premise="The cat sat on the mat near the door.", hypothesis="A cat sat.")


def new_session(tmp_path, name="s"):
    return {"dir": str(tmp_path / name), "capsules": []}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 3-step CaPT run on CB through the app's training generator; (session, states)."""
    session = new_session(tmp_path_factory.mktemp("train"))
    states = list(app.train_run(BB, "cb", "quick: 20 steps", session, session_id="fixture", max_steps=3))
    return session, states


def test_predict_without_capsule_shows_the_bare_backbone():
    fig, report, err = app.predict_view(BB, app.NONE, "rte", **CB)
    assert err == ""
    assert [t.name for t in fig.data] == ["without capsule (zero-shot)"]
    assert list(fig.data[0].x) == ["entailment", "not_entailment"] and sum(fig.data[0].y) == pytest.approx(1)
    assert "zero-shot" in report


def test_train_streams_progress_and_yields_a_usable_capsule(trained, tmp_path):
    session, states = trained
    final = states[-1]
    assert final["error"] == "" and "**Done** (max_steps): 3 steps" in final["progress"]
    answered = re.search(r"What it answered on the test split, gold label \(how many\) → answers: (.*?)\. Always",
                         final["progress"]).group(1)   # CB's test split: 23 / 28 / 5 per gold label
    assert [(g, int(n), sum(map(int, re.findall(r"(\d+) \w+", rest)))) for g, n, rest in
            re.findall(r"(\w+) \((\d+)\) → ([^;]*)", answered)] == [
        ("entailment", 23, 23), ("contradiction", 28, 28), ("neutral", 5, 5)]
    assert any(s["progress"].startswith("step ") for s in states)          # live progress with ETA
    assert final["loss"] is not None and final["dev"] is not None           # live loss and dev curves
    assert final["task"] == ("cb", "", False)
    path = final["capsule"]
    assert path.startswith(session["dir"]) and os.path.isfile(os.path.join(path, "capsule.json"))
    assert [c["path"] for c in session["capsules"]] == [path]
    assert (path, path) in [(v, v) for _, v in app.capsule_choices(BB, session)]
    assert app.capsule_choices("tiny-qwen2", session) == [("none (zero-shot)", app.NONE)]
    with zipfile.ZipFile(final["zip"]) as z:
        assert sorted(n for n in z.namelist() if not n.endswith("/")) == ["capsule/capsule.json",
                                                                           "capsule/capsule.safetensors"]

    fig, report, err = app.predict_view(BB, path, "cb", session=session, **CB)
    assert err == ""
    assert [t.name for t in fig.data] == ["with capsule", "without capsule (zero-shot)"]
    assert "| capsule (W + fusion extras) | 128 |" in report and "% |" in report    # 4 layers x d=32
    assert "Trained on `cb`: 3 steps" in report
    # the same capsule is not readable from another session, nor with another backbone
    assert "unknown capsule" in app.predict_view(BB, path, "cb", session=new_session(tmp_path), **CB)[2]
    assert "trained for backbone" in app.predict_view("tiny-qwen2", path, "cb", session=session, **CB)[2]


def test_generate_shows_the_continuation_without_and_with_the_capsule(trained, tmp_path):
    """The Predict tab's continuation: the example's prompt, then capt.generate's text without and with the
    capsule; a capsule the session cannot read, or empty text, gives the error and nothing else."""
    session, states = trained
    path = states[-1]["capsule"]
    text, err = app.generate_view(BB, path, "cb", session=session, max_new_tokens=4, **CB)
    bb = app.get_backbone(BB)
    cap, cb = capt.load_capsule(path, bb)
    prompt = cb.render(CB, bb.style).prompt
    bare = capt.generate(bb, prompt, max_new_tokens=4)
    mine = capt.generate(bb, prompt, capsule=cap, max_new_tokens=4)
    assert err == "" and text == capt.viz.generation_markdown(prompt, bare, mine)
    assert text.index("**Prompt**") < text.index("**Without capsule**") < text.index("**With capsule**")
    assert f"```text\n{prompt}\n```" in text
    text, err = app.generate_view(BB, app.NONE, "cb", max_new_tokens=4, **CB)
    assert err == "" and "**With capsule**" not in text and "**Without capsule**" in text
    for kw, message in [(dict(capsule=path, session=new_session(tmp_path), **CB), "unknown capsule"),
                        (dict(premise="", hypothesis="x"), "empty text"),
                        (dict(max_new_tokens=0, **CB), "max_new_tokens=0 is out of range")]:
        text, err = app.generate_view(**{"backbone": BB, "task": "cb", **kw})
        assert text == "" and message in err


def test_a_free_text_capsule_uploads_and_generates_after_your_own_prompt(tmp_path):
    """A capsule from `python -m train.lm` (no task) uploaded as a zip: its card says it was trained on free text,
    and the generation view continues the user's own prompt as typed, without and with it (capt.generate's text);
    an own prompt also works with the 'custom' task selected, and a blank one falls back to the task's prompt."""
    from capt.io import export_zip
    from train.lm import main

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {w}:", "completion": f" {w} {w}"}) + "\n"
                            for w in ["cat", "dog", "sun", "tree", "sea", "sky", "hat", "cup", "pen", "box"]))
    assert main(["--data-file", str(data), "--backbone", BB, "--max-steps", "2", "--eval-every", "2",
                 "--out", str(tmp_path / "run")]) == 0
    session = new_session(tmp_path)
    session, path, msg = app.upload_capsule(str(export_zip(tmp_path / "run" / "capsule")), BB, session)
    assert msg == "" and "(no task)" in session["capsules"][-1]["label"]
    assert app.task_choice(path, session) == (None, "", True)   # chosen: the Task box stays, generation opens
    report = app.predict_view(BB, path, "rte", session=session, **CB)[1]
    assert re.search(r"Trained on free text \(9 prompt → completion rows\): 2 steps, best dev loss \d\.\d{4} at "
                     r"step 2 \(the backbone alone: \d\.\d{4}\)", report)
    bb = app.get_backbone(BB)
    cap, task = capt.load_capsule(path, bb)
    bare, mine = (capt.generate(bb, "say cat:", capsule=c, max_new_tokens=3) for c in (None, cap))
    want = capt.viz.generation_markdown("say cat:", bare, mine)
    for task_box in ("rte", app.CUSTOM):
        assert app.generate_view(BB, path, task_box, session=session, max_new_tokens=3, own_prompt="say cat:",
                                 **CB) == (want, "")
    text, err = app.generate_view(BB, path, "cb", session=session, max_new_tokens=3, own_prompt="  ", **CB)
    assert err == "" and f"```text\n{capt.get_task('cb').render(CB, bb.style).prompt}\n```" in text


def write_pairs(path, prompt="q", completion="a"):
    path.write_text("".join(json.dumps({prompt: f"say {w}:", completion: f" {w} {w}"}) + "\n"
                            for w in ["cat", "dog", "sun", "tree", "sea", "sky", "hat", "cup", "pen", "box"]))
    return str(path)


def test_free_text_trains_in_the_browser_and_generates(tmp_path):
    """The Train tab's free-text source: a prompt → completion file trains a capsule (capt.lm_training, live
    curves on the dev loss), selected at once and zipped; it joins the session's table and continues your own
    prompt in the generation view; Stop ends it within one step; bad choices are messages before any training."""
    session = new_session(tmp_path)
    data = write_pairs(tmp_path / "pairs.jsonl")
    states = list(app.train_text_run(BB, "quick: 20 steps", session, session_id="text", data_file=data,
                                     prompt_column="q", completion_column="a", max_steps=3))
    final = states[-1]
    assert final["error"] == "" and final["progress"].startswith("**Done** (max_steps): 3 steps in ")
    assert re.search(r"best dev loss \d\.\d{4} at step \d, the backbone alone \d\.\d{4} \(9 train / 1 dev rows\)",
                     final["progress"])
    assert list(final["loss"].data[0].x) == [1, 2, 3]   # a loss point per step (the live line: the Stop part below)
    assert final["dev"].layout.yaxis.title.text == "loss"
    assert final["task"] == (None, "", True)   # selected: the Task box stays, the generation view opens
    path = final["capsule"]
    entry = session["capsules"][-1]
    assert entry["path"] == path and "trained: free text · 3 steps" in entry["label"]
    with zipfile.ZipFile(final["zip"]) as z:
        assert sorted(n for n in z.namelist() if not n.endswith("/")) == ["capsule/capsule.json",
                                                                           "capsule/capsule.safetensors"]
    assert "| free text | capt | tiny-llama |" in final["runs"] and "dev loss" in final["runs"]
    text, err = app.generate_view(BB, path, "rte", session=session, max_new_tokens=3, own_prompt="say cat:")
    bb = app.get_backbone(BB)
    mine = capt.generate(bb, "say cat:", capsule=capt.load_capsule(path, bb)[0], max_new_tokens=3)
    assert err == "" and f"**With capsule** (computed once, in the prefill over the prompt)\n\n```text\n{mine.text}" \
        in text

    stopping = app.train_text_run(BB, "paper protocol (hours on CPU)", session, session_id="text2", data_file=data,
                                  prompt_column="q", completion_column="a", batch_size=2)
    for s in stopping:
        if s["progress"].startswith("step "):
            assert app.stop_training("text2").startswith("Stopping after this step")
            break
    final = list(stopping)[-1]
    steps = int(re.search(r"\*\*Done\*\* \(stop requested\): (\d+) steps", final["progress"]).group(1))
    assert final["error"] == "" and steps < 500 and os.path.isdir(final["capsule"]) and "text2" not in app._STOPS

    for kw, message in [(dict(method="p-tuning-v2"), "free text trains a CaPT capsule"),
                        (dict(head="linear"), "set head to 'verbalizer'"),
                        (dict(data_file=None), "upload a CSV / JSONL / JSON file"),
                        (dict(completion_column="answer"), r"lacks columns \['answer'\]"),
                        (dict(lr=5), "out of range: lr 5.0"),
                        (dict(preset="fast"), "unknown preset 'fast'")]:
        args = {"data_file": data, "prompt_column": "q", "completion_column": "a", "preset": "quick: 20 steps", **kw}
        out = list(app.train_text_run(BB, session=session, session_id="bad", **args))
        assert out[-1]["capsule"] is None and re.search(message, out[-1]["error"]), (kw, out[-1]["error"])


def test_attention_reads_the_text_the_capsule_scores(tmp_path):
    """With a linear-head capsule on COPA the attention maps show the text its head reads, which lists both
    alternatives; with a verbalizer capsule, the LM prompt (the premise and its connector)."""
    from conftest import random_capsule

    bb, task, session = app.get_backbone(BB), capt.get_task("copa"), new_session(tmp_path)
    copa = dict(premise="The man turned on the faucet.", choice1="The toilet filled with water.",
                choice2="Water flowed from the spout.", question="effect")
    rows = {}
    for head in ("linear", "verbalizer"):
        path = str(capt.save_capsule(random_capsule(bb, head=head), tmp_path / head, bb, task))
        session.setdefault("capsules", []).append({"label": head, "path": path, "backbone": BB})
        *figs, text, err = app.attention_view(BB, path, "copa", session=session, **copa)
        assert err == ""
        ticks = figs[1].layout.yaxis.ticktext    # the bare backbone's map: one row "i:token" per token
        rows[head] = "".join(t.split(":", 1)[1] for t in ticks)
    assert "Option" in rows["linear"] and "spout" in rows["linear"]
    assert "spout" not in rows["verbalizer"] and "therefore" in rows["verbalizer"]


def test_attention_with_and_without_the_capsule(trained):
    session, states = trained
    *figs, text, err = app.attention_view(BB, states[-1]["capsule"], "cb", layer=1, head=2, session=session, **CB)
    with_map, without_map, soft_map, mass_with, mass_without, soft_mass, by_layer = figs
    assert err == "" and soft_map is None is soft_mass and None not in (with_map, without_map, mass_with, by_layer)
    assert capt.CAPSULE_TOKEN in with_map.layout.yaxis.ticktext[0]
    assert with_map.data[0].z.shape[0] == without_map.data[0].z.shape[0] + 1   # one extra slot
    assert len(with_map.layout.shapes) == 2                                     # anchor row and column marked
    assert mass_with.data[0].z.shape == (4, 4) == mass_without.data[0].z.shape  # layers x heads
    assert "layer 1, head 2" in with_map.layout.title.text and "4 layers × 4 heads" in text
    # no capsule chosen: an untrained one (W = 0) shows the anchor; mean over layers and heads
    *figs, text, err = app.attention_view(BB, app.NONE, "rte", **CB)
    assert err == "" and "untrained capsule" in text and "mean over layers and heads" in figs[0].layout.title.text
    assert "layer 9 does not exist" in app.attention_view(BB, app.NONE, "rte", layer=9, **CB)[-1]


def test_bad_inputs_give_messages_not_exceptions(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # read at import, maybe before us

    def err(**kw):
        return app.predict_view(**{"backbone": BB, "capsule": app.NONE, "task": "rte", **CB, **kw})[-1]

    assert "empty text in field 'premise'" in err(premise="")
    assert "unknown task" in err(task="nope")
    assert "unknown backbone" in err(backbone="nope")
    assert "choose a backbone" in err(backbone=" ")
    assert "could not load" in err(hub_id="nobody/no-such-model")          # offline hub: capt's message
    assert "unknown capsule" in err(capsule="/etc")
    assert "needs a capsule trained on your own data" in err(task=app.CUSTOM)
    assert "cause" in app.predict_view(BB, app.NONE, "copa", premise="It rained.", choice1="a", choice2="b",
                                       question="why")[-1]
    session = new_session(tmp_path)
    (tmp_path / "bad.zip").write_text("not a zip")
    for upload in (None, str(tmp_path / "x.txt"), str(tmp_path / "bad.zip")):
        assert "is not a zip file: upload a zipped capsule folder" in app.upload_capsule(upload, BB, session)[2]
    with zipfile.ZipFile(tmp_path / "empty.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    assert "no capsule.json" in app.upload_capsule(str(tmp_path / "empty.zip"), BB, session)[2]
    assert session["capsules"] == []


def train_error(tmp_path, **options):
    states = list(app.train_run(BB, options.pop("task", "cb"), options.pop("preset", "quick: 20 steps"),
                                new_session(tmp_path), session_id="bad", **options))
    assert states[-1]["capsule"] is None
    return states[-1]["error"]


def test_bad_training_input_gives_messages(tmp_path):
    data = tmp_path / "toy.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "y"])
        w.writerows([[f"the {a} number {i}", a[0]] for i in range(10) for a in ("cat", "dog")])
    own = dict(task="toy", data_file=str(data), label_column="y")
    assert "lacks columns ['review']" in train_error(tmp_path, columns="review", label_words="c=yes, d=no", **own)
    assert "bad toy label 'd'" in train_error(tmp_path, columns="text", label_words="c=yes, x=no", **own)
    assert "name the input column" in train_error(tmp_path, columns=" ", label_words="c=yes, d=no", **own)
    assert "label=word" in train_error(tmp_path, columns="text", label_words="c yes", **own)
    (tmp_path / "toy.txt").write_text("text,y\n")
    assert "use a .csv, .jsonl or .json" in train_error(tmp_path, task="toy", data_file=str(tmp_path / "toy.txt"),
                                                       columns="text", label_column="y", label_words="c=yes, d=no")
    assert "no data for task 'toy': upload a file" in train_error(tmp_path, task="toy")   # own file chosen, none given
    assert "unknown preset" in train_error(tmp_path, preset="forever")
    assert "lr=-1.0 is out of range" in train_error(tmp_path, lr=-1)
    assert "layers='middle' is not valid" in train_error(tmp_path, layers="middle")
    assert "layers [9] do not exist" in train_error(tmp_path, layers="9")
    assert app.stop_training("nobody") == "No training is running in this session."


def test_custom_file_capsule_and_upload_round_trip(tmp_path):
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"review": f"the {a} {i}", "stars": a[0]}) + "\n"
                            for i in range(10) for a in ("cat", "dog")))
    session = new_session(tmp_path, "a")
    states = list(app.train_run(BB, "toy", "quick: 20 steps", session, session_id="custom", data_file=str(data),
                                columns="text=review", label_column="stars", label_words="c=yes, d=no", max_steps=2,
                                fusion="project", layers="0, 2"))
    final = states[-1]
    assert final["error"] == "" and final["task"] == (app.CUSTOM, '{"text": ""}', False)
    fig, report, err = app.predict_view(BB, final["capsule"], app.CUSTOM, session=session,
                                        custom_fields='{"text": "the cat 3"}')
    assert err == "" and list(fig.data[0].x) == ["yes", "no"] and "fusion `project`" in report
    assert "JSON object" in app.predict_view(BB, final["capsule"], app.CUSTOM, session=session,
                                             custom_fields="[1")[-1]
    # the downloaded zip uploads into another session; a backbone mismatch is named, not raised
    other = new_session(tmp_path, "b")
    other, value, msg = app.upload_capsule(final["zip"], BB, other)
    assert msg == "" and value in [v for _, v in app.capsule_choices(BB, other)]
    assert app.predict_view(BB, value, app.CUSTOM, session=other, custom_fields='{"text": "a dog"}')[-1] == ""
    third, value, msg = app.upload_capsule(final["zip"], "tiny-qwen2", new_session(tmp_path, "c"))
    assert value is None and "trained for backbone 'tiny-llama'" in msg
    assert [c["backbone"] for c in third["capsules"]] == ["tiny-llama"]


def test_stop_ends_training_and_keeps_the_capsule(tmp_path):
    session, stopped = new_session(tmp_path), False
    for state in app.train_run(BB, "rte", "quick: 20 steps", session, session_id="stopper", max_steps=2000,
                               batch_size=2):
        if state["progress"].startswith("step ") and not stopped:
            assert "Stopping" in app.stop_training("stopper")
            stopped = True
    assert stopped and state["error"] == "" and "(stop requested)" in state["progress"]
    assert os.path.isdir(state["capsule"]) and "stopper" not in app._STOPS


def test_each_backbone_lists_its_own_shipped_capsules():
    """The capsule list follows the backbone: SmolLM2-135M's seven shipped capsules, Gemma-3-270M's own, and
    neither's on the other (a capsule only loads on the backbone it was trained on)."""
    def shipped(backbone):
        return sorted(label for label, _ in app.capsule_choices(backbone, None) if label.startswith("shipped: "))

    smol = ["shipped: " + n for n in ("boolq", "cb", "copa", "copa-text", "multirc", "rte", "wic")]
    assert shipped("smollm2-135m") == smol
    assert shipped("gemma3-270m") == ["shipped: copa"]
    assert all(os.sep + "gemma3-270m" + os.sep in v for label, v in app.capsule_choices("gemma3-270m", None)
               if label.startswith("shipped: "))


def test_choosing_a_shipped_capsule_sets_the_task_box():
    """A capsule chosen from the list sets the Task box to its task; the free-text one leaves it and opens the
    generation view; nothing chosen, or a path that is not on the list, changes nothing."""
    shipped = {os.path.basename(c): str(c) for c in app.find_capsules(app.SHIPPED) if "smollm2-135m" in str(c)}
    for name in ("boolq", "cb", "copa", "multirc", "rte", "wic"):
        assert app.task_choice(shipped[name], None) == (name, "", False)
    assert app.task_choice(shipped["copa-text"], None) == (None, "", True)
    assert app.task_choice(app.NONE, None) == (None, "", False)
    assert app.task_choice("/nowhere/capsule", None) == (None, "", False)


def test_examples_and_field_visibility():
    for name, task in capt.TASKS.items():
        fields, note = app.example_from_val(name, seed=0)
        assert set(fields) == set(task.fields) and "gold label" in note
        shown = [f for f, v in zip(app.FIELDS, app.visible_fields(name)) if v]
        assert set(shown) == set(task.fields)
    assert app.visible_fields(app.CUSTOM) == [False] * len(app.FIELDS) + [True]


def test_a_wic_val_example_keeps_its_word_span():
    """WiC asks about the word as written in sentence 1 (lm-eval's span start1:end1), not its lemma: a val
    example loaded into the form predicts exactly as capt.predict on that example, until a box is edited."""
    bb, wic = app.get_backbone(BB), capt.get_task("wic")
    fields, note, picked = next(v for v in (app.example_from_val("wic", seed=s, whole=True) for s in range(100))
                                if v[2]["sentence1"][v[2]["start1"]:v[2]["end1"]] != v[2]["word"])
    example = {k: v for k, v in picked.items() if k != "task"}   # the val example as load_examples gives it
    assert set(fields) == set(wic.fields) and "gold label" in note
    span = example["sentence1"][example["start1"]:example["end1"]]
    assert f"the word '{span}'" in wic.render(app.make_example(wic, fields, picked), "lm").prompt
    expected = capt.predict(bb, "wic", example)
    fig, _, err = app.predict_view(BB, app.NONE, "wic", picked=picked, **fields)
    assert err == "" and list(fig.data[0].y) == [expected.probs[label] for label in wic.labels]
    assert capt.predict(bb, "wic", fields).probs != expected.probs   # the lemma alone gives another prompt
    assert app.attention_view(BB, app.NONE, "wic", picked=picked, **fields)[-1] == ""
    # once a box is edited, the span may point anywhere: the form's own fields alone are used
    edited = {**fields, "sentence1": "Edited: " + fields["sentence1"]}
    fig, _, err = app.predict_view(BB, app.NONE, "wic", picked=picked, **edited)
    assert err == "" and list(fig.data[0].y) == list(capt.predict(bb, "wic", edited).probs.values())
    assert list(app.predict_view(BB, app.NONE, "rte", picked=picked, **CB)[0].data[0].y) == list(
        capt.predict(bb, "rte", CB).probs.values())   # another task ignores the picked example


def test_gradio_client_round_trip(tmp_path, monkeypatch, serve):
    from gradio_client import Client, handle_file

    monkeypatch.setattr(app, "WORK_DIR", tmp_path / "sessions")   # the server's per-session folders
    url = serve(app.build_demo())
    client = Client(url, verbose=False)
    try:
        api = client.view_api(print_info=False, return_format="dict")
        assert set(api["named_endpoints"]) == {"/predict", "/generate", "/attention", "/probe", "/train", "/stop"}
        assert api["unnamed_endpoints"] == {}
        fig, report, err = client.predict(backbone=BB, capsule=app.NONE, task="rte", api_name="/predict",
                                          premise="The cat sat.", hypothesis="A cat sat.")
        assert err == "" and fig["type"] == "plotly" and "zero-shot" in report
        *figs, text, err = client.predict(backbone=BB, task="rte", premise="The cat sat.", hypothesis="A cat sat.",
                                          layer=-1, head=0, api_name="/attention")
        assert err == "" and len(figs) == 7 and "4 layers × 4 heads" in text
        assert figs[2] is None and figs[0]["type"] == "plotly"
        out = client.predict(backbone=BB, task="cb", preset="quick: 20 steps", max_steps=2, api_name="/train")
        loss, dev, progress, err, zip_file, _backbone, _hub, capsule, task = out[:9]
        assert err == "" and "**Done** (max_steps): 2 steps" in progress and zip_file.endswith(".zip")
        assert task == "cb" and loss["type"] == "plotly"
        path = capsule["value"]   # the Capsule dropdown's update: the new capsule, selected
        fig, report, err = client.predict(backbone=BB, capsule=path, task="cb", premise="The cat sat.",
                                          hypothesis="A cat sat.", api_name="/predict")
        assert err == "" and "| capsule (W + fusion extras) | 128 |" in report
        text, err = client.predict(backbone=BB, capsule=path, task="cb", premise="The cat sat.", hypothesis="A cat sat.",
                                   max_new_tokens=3, api_name="/generate")
        assert err == "" and "**With capsule**" in text
        text, err = client.predict(backbone=BB, capsule=path, task="cb", own_prompt="Once upon a time",
                                   max_new_tokens=3, api_name="/generate")
        assert err == "" and text.startswith("**Prompt**\n\n```text\nOnce upon a time\n```")
        out = client.predict(backbone=BB, source=app.OWN_TEXT, data_file=handle_file(write_pairs(tmp_path / "p.jsonl")),
                             prompt_column="q", completion_column="a", preset="quick: 20 steps", max_steps=2,
                             api_name="/train")   # free text through the same endpoint: its own columns
        progress, err, capsule, note = out[2], out[3], out[7], out[10]   # the accordion is not an output here
        assert err == "" and progress.startswith("**Done** (max_steps): 2 steps")
        assert note == app.FREE_TEXT_NOTE   # and the generation view opens: what such a capsule is for
        assert "free text" in capsule["choices"][-1][0]
        # another client is another session: it cannot read the first one's capsule
        other = Client(url, verbose=False)
        assert "unknown capsule" in other.predict(backbone=BB, capsule=path, task="cb", premise="a", hypothesis="b",
                                                  api_name="/predict")[-1]
        other.close()
        assert client.predict(api_name="/stop") == "No training is running in this session."
        assert "empty text" in client.predict(backbone=BB, task="rte", premise="", hypothesis="x",
                                              api_name="/predict")[-1]
    finally:
        client.close()


def test_probe_view_measures_accuracy_per_number_of_pooled_tokens(trained):
    session, states = trained
    fig, text, err = app.probe_view(BB, states[-1]["capsule"], "cb", n_examples=8, ks=[1, 3], session=session)
    assert err == "" and list(fig.data[0].x) == ["0", "1", "3"] and all(0 <= y <= 1 for y in fig.data[0].y)
    # the same numbers as the library's probe on the same fixed sample
    bb, task = app.get_backbone(BB), capt.get_task("cb")
    capsule, _ = capt.load_capsule(states[-1]["capsule"], bb)
    import random
    from capt.analysis import pooled_token_probe
    sample = random.Random(0).sample(capt.load_examples(task, "val"), 8)
    assert list(fig.data[0].y) == list(pooled_token_probe(bb, task, sample, capsule, ks=[0, 1, 3]).values())
    assert "k=0" in text and "8 random cb val examples" in text
    _, text, err = app.probe_view(BB, app.NONE, "cb", n_examples=8, ks=[1], session=session)
    assert err == "" and "untrained deep prompt" in text
    assert "out of range" in app.probe_view(BB, app.NONE, "cb", n_examples=2, ks=[1])[-1]
    assert "choose one or more" in app.probe_view(BB, app.NONE, "cb", n_examples=8, ks=[])[-1]


def test_a_baseline_trains_on_the_same_data_and_joins_the_comparison(trained, tmp_path):
    """A prompt-tuning run beside the CaPT run: both in the session's table; its soft prompt is offered in the
    Attention tab and shown there next to the capsule and the sink."""
    session, states = trained
    last = list(app.train_run(BB, "cb", "quick: 20 steps", session, session_id="pt", max_steps=3,
                              method="prompt-tuning"))[-1]
    assert last["error"] == "" and last["capsule"] is None and last["zip"].endswith(".zip")
    assert "| capt |" in last["runs"] and "| prompt-tuning |" in last["runs"]
    assert all(re.search(r"\| '\w+' \d+\.\d % \|$", line) for line in last["runs"].splitlines()[-2:])  # CB's bar
    (label, path), = [c for c in app.soft_prompt_choices(BB, session) if c[1] != app.NONE]
    assert "prompt-tuning" in label and os.path.isfile(os.path.join(path, "adapter_config.json"))
    with zipfile.ZipFile(last["zip"]) as z:
        assert any(n.endswith("adapter_model.safetensors") for n in z.namelist())
    *figs, text, err = app.attention_view(BB, states[-1]["capsule"], "cb", session=session, soft_prompt=path, **CB)
    soft_map, soft_mass, by_layer = figs[2], figs[5], figs[6]
    assert err == "" and soft_map is not None and soft_mass.data[0].z.shape == (4, 4)
    assert soft_map.layout.yaxis.ticktext[0].startswith("0:⟨soft:1⟩") and len(by_layer.data) == 3
    assert "soft prompt (20 tokens)" in text
    assert "unknown soft prompt" in app.attention_view(BB, app.NONE, "cb", soft_prompt=str(tmp_path), **CB)[-1]
    # the linear head keeps no artifact but still joins the table; an unknown method is refused
    last = list(app.train_run(BB, "cb", "quick: 20 steps", session, session_id="lh", max_steps=2,
                              method="linear-head"))[-1]
    assert last["error"] == "" and last["zip"] is None and "| linear-head |" in last["runs"]
    assert "unknown method 'lora'" in list(app.train_run(BB, "cb", "quick: 20 steps", session, method="lora"))[-1][
        "error"]


def zerogpu_chunks(monkeypatch, calls):
    """Training as on a ZeroGPU Space: each chunk a call of spaces.GPU(train_chunk) in a forked worker process,
    its arguments and events pickled (tests/fake_zerogpu.py); calls gets (budget in minutes, resume) per chunk."""
    gpu = app.on_gpu(60, app.train_chunk, gpu=fake_zerogpu.GPU)

    def chunk(cfg, resume, stop):
        calls.append((cfg.max_minutes, resume))
        yield from gpu(cfg, resume, stop)
    monkeypatch.setattr(app, "gpu_train_chunk", chunk)


def test_zerogpu_trains_in_resumed_chunks(tmp_path, monkeypatch, training_clock):
    """With `spaces` present, training runs as several GPU calls, each in its own worker process, that each
    resume the run: the chunks together take exactly the steps of one uninterrupted run and end with its
    capsule, and the page sees every step's event."""
    calls = []
    zerogpu_chunks(monkeypatch, calls)
    monkeypatch.setattr(app, "GPU_CHUNK_S", 0.05)   # a chunk ends after a few steps of training_clock
    session = new_session(tmp_path)
    states = list(app.train_run(BB, "cb", "quick: 20 steps", session, session_id="zero", max_steps=6, batch_size=2))
    last = states[-1]
    assert last["error"] == "" and "**Done** (max_steps): 6 steps" in last["progress"]
    assert len(calls) > 1 and calls[0][1] is False and all(resume for _, resume in calls[1:])
    assert [budget for budget, _ in calls] == pytest.approx([k * 0.05 / 60 for k in range(1, len(calls) + 1)])
    steps = [json.loads(line) for line in open(os.path.join(os.path.dirname(last["capsule"]), "metrics.jsonl"))]
    assert [e["step"] for e in steps if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]   # no step twice, none lost
    assert len(last["loss"].data[0].x) == 6   # the curves got the worker's step events
    assert app.predict_view(BB, last["capsule"], "cb", session=session, **CB)[-1] == ""


def test_zerogpu_trains_free_text_in_resumed_chunks(tmp_path, monkeypatch):
    """Free-text training on ZeroGPU: GPU calls of spaces.GPU(train_text_chunk), each in its own worker process and
    each resuming where the one before ended, take steps 1..6 once each and end with a usable capsule."""
    calls, gpu = [], app.on_gpu(60, app.train_text_chunk, gpu=fake_zerogpu.GPU)

    def chunk(name, pairs, out, config, options, resume, stop):
        calls.append((options["max_minutes"], resume))
        yield from gpu(name, pairs, out, config, options, resume, stop)
    monkeypatch.setattr(app, "gpu_text_chunk", chunk)
    monkeypatch.setattr(app, "GPU_CHUNK_S", 1e-4)   # a chunk ends after its first step (a tiny model's take ms)
    session = new_session(tmp_path)
    states = list(app.train_text_run(BB, "quick: 20 steps", session, session_id="zero-text", max_steps=6,
                                     data_file=write_pairs(tmp_path / "p.jsonl"), prompt_column="q",
                                     completion_column="a", batch_size=3))
    last = states[-1]
    assert last["error"] == "" and last["progress"].startswith("**Done** (max_steps): 6 steps")
    assert len(calls) == 6 and calls[0][1] is False and all(resume for _, resume in calls[1:])
    assert [budget for budget, _ in calls] == pytest.approx([k * 1e-4 / 60 for k in range(1, 7)])
    assert list(last["loss"].data[0].x) == [1, 2, 3, 4, 5, 6]   # every worker's step events, none twice
    text, err = app.generate_view(BB, last["capsule"], "rte", session=session, max_new_tokens=2, own_prompt="say a:")
    assert err == "" and "**With capsule**" in text


def test_zerogpu_stop_and_errors_cross_the_process(tmp_path, monkeypatch):
    """Stop pressed in the page reaches the training in the GPU worker (within one step, best capsule kept);
    an error raised there reaches the page with its own message, not just its class name."""
    zerogpu_chunks(monkeypatch, [])
    session = new_session(tmp_path)
    run = app.train_run(BB, "cb", "quick: 20 steps", session, session_id="zero-stop", max_steps=5000, batch_size=2)
    for state in run:
        if "step 2" in state["progress"] or "step 3" in state["progress"]:
            assert "Stopping" in app.stop_training("zero-stop")
            break
    last = list(run)[-1]
    assert last["error"] == "" and "(stop requested)" in last["progress"] and last["capsule"]

    def broken(*args, **kwargs):
        raise capt.CaptError("the checkpoint in runs/x was written by another run")
    monkeypatch.setattr(app, "train", broken)   # inherited by the worker process at its fork
    last = list(app.train_run(BB, "cb", "quick: 20 steps", session, session_id="zero-err", max_steps=2))[-1]
    assert "the checkpoint in runs/x was written by another run" in last["error"]


def test_a_training_chunk_closed_early_stops_the_run(tmp_path):
    """ZeroGPU closes the chunk's generator when the page goes away: the run's stop flag is set, so training
    ends within one step; a chunk read to its end leaves the flag alone for the next chunk."""
    cfg = app.train_config(BB, "cb", "quick: 20 steps", str(tmp_path / "run"), max_steps=5000, batch_size=2)
    stop = app.StopFile(tmp_path / "stop")
    chunk = app.train_chunk(cfg, False, stop)
    assert next(chunk)["kind"] in ("step", "eval") and not stop.is_set()
    chunk.close()
    assert stop.is_set()
    cfg = app.train_config(BB, "cb", "quick: 20 steps", str(tmp_path / "run2"), max_steps=2, batch_size=2)
    stop = app.StopFile(tmp_path / "stop2")
    events = list(app.train_chunk(cfg, False, stop))
    assert events[-1]["kind"] == "finished" and events[-1]["summary"]["steps"] == 2 and not stop.is_set()


def test_zerogpu_views_take_and_return_plain_data(trained):
    """Predict, the continuation, attention and probe as ZeroGPU calls (forked worker, pickled arguments and
    results) give what the plain calls give."""
    session, states = trained
    capsule = states[-1]["capsule"]
    for view, kwargs in ((app.predict_view, CB), (app.generate_view, dict(max_new_tokens=3, **CB)),
                         (app.attention_view, dict(layer=1, head=0, **CB)),
                         (app.probe_view, dict(n_examples=8, ks=[1, 2]))):
        here = view(BB, capsule, "cb", session=session, **kwargs)
        there = app.on_gpu(60, view, gpu=fake_zerogpu.GPU)(BB, capsule, "cb", session=session, **kwargs)
        assert here[-1] == there[-1] == "" and here[-2] == there[-2]   # no error; the same report
        data = lambda figs: [None if f is None else f.to_dict()["data"] for f in figs]   # noqa: E731
        assert data(here[:-2]) == data(there[:-2])


def test_zerogpu_worker_runs_after_the_main_process_used_several_threads():
    """A worker forked after torch ran a multi-threaded CPU operation here would hang in its first one (OpenMP's
    pool does not survive a fork); on_gpu drops the worker to one thread, so the call completes."""
    import functools

    import torch
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum()   # the main process's OpenMP pool is now in use
        fig, report, err = app.on_gpu(60, app.predict_view, gpu=functools.partial(fake_zerogpu.GPU, timeout=30))(
            BB, app.NONE, "cb", **CB)
        assert err == "" and torch.get_num_threads() == 2   # only the worker dropped to one thread
    finally:
        torch.set_num_threads(before)


def test_a_capsule_from_the_hub_and_a_push_to_it(trained, tmp_path, monkeypatch):
    """A Hub repo id typed into the Capsule box is pulled (capsule files only) and joins the session; the latest
    trained capsule is pushed with the token given, private by default. The Hub is faked: none is reachable."""
    session, states = trained
    import shutil
    remote = tmp_path / "remote"
    shutil.copytree(states[-1]["capsule"], remote)
    pulled, pushed = [], []
    monkeypatch.setattr(app, "pull_from_hub", lambda repo_id: pulled.append(repo_id) or remote)
    other = new_session(tmp_path, "hub")
    fig, report, err = app.predict_view(BB, "someone/capt-cb", "cb", session=other, **CB)
    assert err == "" and pulled == ["someone/capt-cb"] and "Trained on `cb`" in report
    assert ("hub: someone/capt-cb", str(remote)) in app.capsule_choices(BB, other)
    assert "Hub repo id like" in app.predict_view(BB, "../etc", "cb", session=other, **CB)[-1]

    def offline(repo_id):
        raise capt.CaptError(f"could not download capsule '{repo_id}' from the hub (offline)")
    monkeypatch.setattr(app, "pull_from_hub", offline)
    assert "could not download capsule 'a/b'" in app.predict_view(BB, "a/b", "cb", session=other, **CB)[-1]

    monkeypatch.setattr(app, "push_to_hub", lambda folder, repo, token, private: pushed.append(
        (folder, repo, token, private)) or f"https://huggingface.co/{repo}")
    assert app.push_capsule("me/capt-cb", " hf_x ", session) == "Pushed to https://huggingface.co/me/capt-cb (private)."
    assert pushed == [(states[-1]["capsule"], "me/capt-cb", "hf_x", True)]
    assert "write token" in app.push_capsule("me/capt-cb", "", session)
    assert "'not a repo' is not a Hub model id; give one like 'your-name/capt-cb'" in app.push_capsule(
        "not a repo", "hf_x", session)
    assert "train a capsule in this session first" in app.push_capsule("me/capt-cb", "hf_x", other)


def test_training_data_from_a_hub_dataset_id(tmp_path, monkeypatch):
    """The Train tab's Hub dataset id reaches load_examples as the source; offline, the run ends with a message
    naming the way out (the local files), before any backbone is loaded."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    session = new_session(tmp_path)
    last = list(app.train_run(BB, "cb", "quick: 20 steps", session, hub_dataset="aps/super_glue", max_steps=2))[-1]
    assert "aps/super_glue" in last["error"] and "Local data" in last["error"] and last["capsule"] is None
    error = list(app.train_run(BB, "cb", "quick: 20 steps", session, hub_dataset="no such"))[-1]["error"]
    assert "'no such' is not a Hub dataset id; give one like 'aps/super_glue'" in error
    assert app.train_config(BB, "cb", "quick: 20 steps", str(tmp_path), hub_dataset=" aps/super_glue ").source == \
        "aps/super_glue"


def test_training_jobs_queue_one_at_a_time_with_a_position(tmp_path, monkeypatch, serve):
    """Two users start training at once: one trains, the other waits in the queue and is told its position;
    a prediction meanwhile is not held up behind them. Stopping the first lets the second run."""
    import time

    from gradio_client import Client

    monkeypatch.setattr(app, "WORK_DIR", tmp_path / "sessions")
    real, calls = app.run_training, []

    def first_one_runs_until_stopped(cfg, bb, emit, stop):   # a tiny model trains too fast to queue behind
        calls.append(cfg.task)
        while len(calls) == 1 and not stop.is_set():
            time.sleep(0.1)
            emit({"kind": "info", "text": "training…"})
        return real(cfg, bb, emit, stop)
    monkeypatch.setattr(app, "run_training", first_one_runs_until_stopped)
    url = serve(app.build_demo())
    first, second = Client(url, verbose=False), Client(url, verbose=False)
    try:
        a = first.submit(backbone=BB, task="rte", preset="quick: 20 steps", max_steps=2000, batch_size=2,
                         api_name="/train")
        deadline = time.time() + 60
        while calls != ["rte"]:   # the first one is training
            assert time.time() < deadline, a.status()
            time.sleep(0.2)
        b = second.submit(backbone=BB, task="cb", preset="quick: 20 steps", max_steps=2, api_name="/train")
        while b.status().code.name not in ("IN_QUEUE", "PROCESSING", "FINISHED"):
            assert time.time() < deadline, b.status()
            time.sleep(0.1)
        status = b.status()
        assert status.code.name == "IN_QUEUE" and status.rank == 0, status   # next in line, and told so
        fig, report, err = second.predict(backbone=BB, task="rte", premise="a", hypothesis="b", api_name="/predict")
        assert err == "" and b.status().code.name == "IN_QUEUE"   # predictions do not wait for training
        assert "Stopping" in first.predict(api_name="/stop")
        out = b.result(timeout=120)
        assert out[3] == "" and "**Done** (max_steps): 2 steps" in out[2]
        assert "(stop requested)" in a.result(timeout=120)[2] and calls == ["rte", "cb"]
    finally:
        first.close()
        second.close()
