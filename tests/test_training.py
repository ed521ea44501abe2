"""The training function and CLI on tiny models: files, learning, stop, resume, compare, bad input."""
import csv
import json
import re
import shutil
import threading
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file

import capt
from capt import viz
from capt.methods import METHODS
from capt.training import (Pace, TrainConfig, _finished_run, compare, describe_machine, format_table, saved_config,
                           train, train_in_chunks, train_seeds)
from conftest import tiny
from train.__main__ import main as cli


@pytest.fixture
def toy_csv(tmp_path):
    """A trivially learnable task: the animal decides the label."""
    path = tmp_path / "toy.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "y"])
        for i in range(40):
            animal = "cat" if i % 2 == 0 else "dog"
            w.writerow([f"the {animal} number {i} sat there", "a" if animal == "cat" else "b"])
    return path


def toy(toy_csv, tmp_path, **kw):
    base = dict(task="toy", backbone="tiny-llama", data_file=str(toy_csv), fields=["text"],
                columns={"text": "text"}, label_column="y", label_words={"a": " the", "b": " a"},
                batch_size=4, eval_every=2, out_dir=str(tmp_path / "run"))
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("method", METHODS)
def test_three_step_run_writes_its_files(method, tmp_path):
    bb = tiny("tiny-t5" if method == "p-tuning-v2" else "tiny-llama")
    cfg = TrainConfig(task="cb", method=method, backbone=bb.name, max_steps=3, eval_every=2, max_train=24,
                      max_dev=6, max_test=6, out_dir=str(tmp_path / method))
    summary = train(cfg, bb, progress=False)
    run = tmp_path / method
    saved = json.loads((run / "summary.json").read_text())
    assert saved["method"] == method and set(saved["test"]) == {"accuracy", "macro_f1"}
    counts = saved["test_counts"]   # gold -> predicted, every pair of labels, zeros kept
    assert list(counts) == ["entailment", "contradiction", "neutral"]
    assert all(list(r) == list(counts) for r in counts.values())
    assert sum(n for r in counts.values() for n in r.values()) == saved["n_test"] == 6
    assert sum(counts[g][g] for g in counts) / 6 == pytest.approx(saved["test"]["accuracy"])
    if method == "majority":   # one answer for every example
        assert sum(any(r[p] for r in counts.values()) for p in counts) == 1
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if method in ("zero-shot", "majority"):
        assert summary["steps"] == 0 and summary["n_trainable"] == 0
    else:
        assert summary["steps"] == 3 and [r["step"] for r in log if r["kind"] == "step"] == [1, 2, 3]
        assert [r["step"] for r in log if r["kind"] == "eval"] == [2, 3]
        assert summary["n_trainable"] > 0
    if method in ("capt", "deep-prompt-1"):
        cap, task = capt.load_capsule(run / "capsule", bb)
        assert task.name == "cb" and cap.n_capsule_params() == summary["n_trainable"]
        assert json.loads((run / "capsule" / "capsule.json").read_text())["metrics"] == summary["test"]
        if method == "deep-prompt-1":
            assert cap.config.fusion == "none"
    assert log[-1]["kind"] == "done"


def test_label_counts_cross_gold_with_predicted_in_label_order():
    from capt.training import label_counts

    task = capt.get_task("cb")   # entailment, contradiction, neutral
    counts = label_counts(task, preds=[0, 0, 1, 0, 1], golds=[0, 1, 1, 2, 2])
    assert counts == {"entailment": {"entailment": 1, "contradiction": 0, "neutral": 0},
                      "contradiction": {"entailment": 1, "contradiction": 1, "neutral": 0},
                      "neutral": {"entailment": 1, "contradiction": 1, "neutral": 0}}


def test_evaluate_scores_a_saved_capsule_again_as_training_did(tmp_path, capsys):
    """`python -m train evaluate` rebuilds the capsule's split from its capsule.json and gets the test and dev
    metrics the run recorded, with what it answered per gold label; bad input is a clear message."""
    from capt.training import evaluate_capsule

    bb = tiny("tiny-llama")
    cfg = TrainConfig(task="cb", backbone=bb.name, max_steps=4, eval_every=2, max_train=24, max_dev=8,
                      max_test=10, out_dir=str(tmp_path / "run"))
    summary = train(cfg, bb, progress=False)
    folder = tmp_path / "run" / "capsule"
    out = tmp_path / "eval.json"
    assert cli(["evaluate", "--capsule", str(folder), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{folder} on cb test (10 examples; " in printed and "the same as it recorded when it was saved" in printed
    result = json.loads(out.read_text())
    assert result["metrics"] == summary["test"] and result["same_as_recorded"] is True
    assert result["counts"] == summary["test_counts"] and result["command"].startswith("python -m train evaluate")
    for gold, row in result["counts"].items():
        assert f"| {gold} ({sum(row.values())}) | " + " | ".join(map(str, row.values())) + " |" in printed
    totals = {g: sum(row.values()) for g, row in result["counts"].items()}   # the bar of one answer everywhere
    top = max(totals, key=totals.get)
    assert f"saved. Always answering '{top}' would score {10 * totals[top]:.1f} % accuracy here.\n" in printed
    dev = evaluate_capsule(folder, "dev", bb)   # the kept state's dev metrics, measured when it was kept
    assert dev["n"] == 8 and dev["metrics"] == summary["dev"] and dev["same_as_recorded"] is True
    assert cli(["evaluate", "--capsule", str(tmp_path)]) == 2
    assert "is not a capsule folder: it has no capsule.json" in capsys.readouterr().err
    with pytest.raises(capt.CaptError, match="split must be 'test' or 'dev'"):
        evaluate_capsule(folder, "train", bb)


def test_loss_goes_down_on_a_learnable_task(toy_csv, tmp_path):
    losses = []
    summary = train(toy(toy_csv, tmp_path, lr=0.1, max_steps=40, eval_every=10),
                    callback=lambda e: e["kind"] == "step" and losses.append(e["loss"]), progress=False)
    assert sum(losses[-8:]) / 8 < 0.5 * sum(losses[:8]) / 8
    assert summary["test"]["accuracy"] == 1.0


def test_the_same_seed_trains_the_same_capsule_bit_for_bit(toy_csv, tmp_path):
    """A seeded run is repeatable (fresh backbone each time): the capsule, the losses and the chosen step;
    another seed trains another capsule. The summary names the code that did it."""
    def run(seed, name):
        losses = []
        s = train(toy(toy_csv, tmp_path, max_steps=6, seed=seed, out_dir=str(tmp_path / name)), tiny("tiny-llama"),
                  callback=lambda e: e["kind"] == "step" and losses.append(e["loss"]), progress=False)
        return s, losses, load_file(tmp_path / name / "capsule" / "capsule.safetensors")["weight"]

    (a, la, wa), (b, lb, wb), (_, _, wc) = run(0, "a"), run(0, "b"), run(1, "c")
    assert torch.equal(wa, wb) and la == lb and a["best_step"] == b["best_step"] and a["test"] == b["test"]
    assert not torch.equal(wa, wc)
    code = a["code"]
    assert code["capt"] == capt.__version__ and code["torch"] == torch.__version__
    assert code["threads"] == torch.get_num_threads()
    assert code["machine"] == describe_machine("cpu") and code["machine"]["gpu"] is None   # a CPU run
    assert code["commit"] is None or (len(code["commit"]) == 40 and isinstance(code["dirty"], bool))


def test_callback_reports_progress(toy_csv, tmp_path):
    events = []
    train(toy(toy_csv, tmp_path, max_steps=4), callback=events.append, progress=False)
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4] and all(e["total_steps"] == 4 for e in steps)
    assert all(e["examples_per_s"] > 0 and e["eta_s"] >= 0 for e in steps) and steps[-1]["eta_s"] == 0
    assert events[-1]["kind"] == "done"


def test_the_eta_follows_the_pace_of_the_last_eval_every_steps():
    """The ETA's seconds per step come from the last eval_every steps, not the whole session: ten 10 s steps
    (the linear head's first epoch, computing features), then 1 s steps (cached): after three of those, a window
    of 3 says 1 s where the session average would still say 7.75 s; the first steps read as the average."""
    pace = Pace(3)
    assert [pace.tick(10.0 * k) for k in range(1, 4)] == [10.0, 10.0, 10.0]
    for k in range(4, 11):
        pace.tick(10.0 * k)
    assert [pace.tick(100.0 + k) for k in (1, 2, 3)] == [(101 - 80) / 3, (102 - 90) / 3, 1.0]
    assert Pace(50, start=5.0).tick(7.0) == 2.0


def test_stop_ends_within_one_step_and_keeps_the_best(toy_csv, tmp_path):
    stop = threading.Event()

    def on_event(e):
        if e["kind"] == "step" and e["step"] == 3:
            stop.set()

    summary = train(toy(toy_csv, tmp_path, max_steps=50), callback=on_event, stop=stop, progress=False)
    assert summary["steps"] == 3 and summary["stopped_by"] == "stop requested"
    assert (tmp_path / "run" / "capsule" / "capsule.safetensors").exists()
    assert summary["best_step"] in (2, 3)


def test_resume_continues_where_it_stopped(toy_csv, tmp_path):
    """Stop after 4 steps, resume to 8: same capsule as 8 uninterrupted steps, log without repeats."""
    straight = train(toy(toy_csv, tmp_path / "a", max_steps=8, eval_every=1), progress=False)
    stop = threading.Event()
    cfg = toy(toy_csv, tmp_path / "b", max_steps=8, eval_every=1)
    train(cfg, callback=lambda e: e["kind"] == "eval" and e["step"] == 4 and stop.set(), stop=stop, progress=False)
    resumed = train(cfg, resume=True, progress=False)
    assert resumed["steps"] == 8 and straight["steps"] == 8
    a = load_file(str(tmp_path / "a" / "run" / "checkpoint" / "state.safetensors"))
    b = load_file(str(tmp_path / "b" / "run" / "checkpoint" / "state.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a if k.startswith("param/"))
    log = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "step"] == list(range(1, 9))
    (res,) = [r for r in log if r["kind"] == "resume"]   # which code and machine trained before and after it
    assert res["code"] == res["checkpoint_code"] == json.loads(json.dumps(resumed["code"]))
    assert {"commit", "torch", "threads", "machine"} <= set(res["code"]) and res["code"]["machine"]["cpu"]
    assert resumed["trained_on"] == [{"from_step": 0, "code": res["code"]},
                                     {"from_step": 4, "from_seconds": res["elapsed_s"], "code": res["code"]}]
    assert straight["trained_on"] == [{"from_step": 0, "code": straight["code"]}]


def test_a_card_says_which_steps_ran_on_which_machine():
    """A run resumed on another machine: the card's Training line names each machine with its steps and seconds
    (from the summary's trained_on); parts on one machine read as one; one machine reads as before."""
    import train.card as card_module

    def code(cpu):
        return {"torch": "2.13.0+cpu", "machine": {"cores": 2, "cpu": cpu, "isa": "AVX512", "gpu": None}}
    xeon, epyc = code("Intel Xeon"), code("AMD EPYC")
    summary = {"steps": 1200, "train_seconds": 5000.0, "code": epyc, "trained_on": [
        {"from_step": 0, "code": xeon}, {"from_step": 350, "from_seconds": 1200.0, "code": xeon},
        {"from_step": 600, "from_seconds": 2000.0, "code": epyc}]}
    assert card_module._where_trained(summary) == (
        "2 set-ups in turn (resumed from checkpoints): steps 0-600 (2000 s) on 2 CPU cores (Intel Xeon, AVX512), "
        "torch 2.13.0+cpu, no GPU; steps 600-1200 (3000 s) on 2 CPU cores (AMD EPYC, AVX512), torch 2.13.0+cpu, "
        "no GPU")
    one = {**summary, "code": xeon, "trained_on": summary["trained_on"][:2]}
    assert card_module._where_trained(one) == card_module._machine(one) == (
        "2 CPU cores (Intel Xeon, AVX512), torch 2.13.0+cpu, no GPU")
    unknown = {**summary, "trained_on": [{"from_step": 0, "code": None}] + summary["trained_on"][2:]}
    assert card_module._where_trained(unknown).startswith(
        "2 set-ups in turn (resumed from checkpoints): steps 0-600 (2000 s) on a machine its checkpoint did not "
        "record; steps 600-1200 (3000 s) on 2 CPU cores (AMD EPYC")


def test_a_card_says_which_steps_ran_at_which_commit():
    """A run resumed at other commits: the card's Code line names each commit with its steps (parts at one
    commit read as one; a checkpoint from before runs recorded their code says so), and its promise is to
    rerun in the same parts; a run at one commit reads as before."""
    import train.card as card_module

    def code(commit, dirty=False):
        return {"capt": "0.1.0", "transformers": "5.24.0", "threads": 2, "commit": commit, "dirty": dirty}
    summary = {"steps": 1000, "code": code("c" * 40), "trained_on": [
        {"from_step": 0, "code": code("a" * 40)}, {"from_step": 250, "code": code("b" * 40, dirty=True)},
        {"from_step": 400, "code": code("b" * 40, dirty=True)}, {"from_step": 500, "code": code("c" * 40)}]}
    line = card_module._code(summary)
    assert line.startswith(f"\n- Code: capt 0.1.0 (steps 0-250 at commit {'a' * 10}, steps 250-500 at commit "
                           f"{'b' * 10} with uncommitted edits to capt/ or train/, steps 500-1000 at commit {'c' * 10}: "
                           "resumed from checkpoints")
    assert line.endswith(card_module.REPRODUCE_PARTS) and "in the same parts at the same commits" in line
    unknown = {**summary, "trained_on": [{"from_step": 0, "code": None}] + summary["trained_on"][3:]}
    assert "(steps 0-500 at a commit its checkpoint did not record, steps 500-1000 at commit" in card_module._code(unknown)
    one = {**summary, "trained_on": [{"from_step": 0, "code": code("c" * 40)}, {"from_step": 500, "code": code("c" * 40)}]}
    assert card_module._code(one) == card_module._code({"code": summary["code"]}) == (
        f"\n- Code: capt 0.1.0 (commit {'c' * 10}), transformers 5.24.0, torch threads: 2. " + card_module.REPRODUCE)


def test_resume_of_a_killed_run_logs_each_step_once(toy_csv, tmp_path):
    """A run killed between checkpoints logged steps its checkpoint does not keep; the resumed run runs them
    again, and the log reads as one run: every step once, in order, with a `resume` record where it resumed."""
    cfg = toy(toy_csv, tmp_path, max_steps=6, eval_every=2)

    def kill(e):
        if e["kind"] == "step" and e["step"] == 3:
            raise KeyboardInterrupt   # after step 3 was logged; the checkpoint holds step 2

    with pytest.raises(KeyboardInterrupt):
        train(cfg, callback=kill, progress=False)
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "step"] == [1, 2, 3]
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "st')   # a line the kill cut short
    state = tmp_path / "run" / "checkpoint" / "state.json"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "trained_on"}))
    assert train(cfg, resume=True, progress=False)["steps"] == 6
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "step"] == list(range(1, 7))
    assert [r["step"] for r in log if r["kind"] == "eval"] == [2, 4, 6]
    assert [(r["step"], r["dropped_records"], r["checkpoint_code"]) for r in log if r["kind"] == "resume"] == [
        (2, 2, None)]   # a checkpoint from before they recorded their writer: steps 0-2 by unknown code
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [(s["from_step"], s["code"] is None) for s in summary["trained_on"]] == [(0, True), (2, False)]
    assert [r["kind"] for r in log].index("resume") == 3 and log[-1]["kind"] == "done"


def test_a_moved_finished_compare_is_kept_as_it_is(toy_csv, tmp_path):
    """Runs finished in one folder and moved to another (renamed, or gathered into a compare) are finished
    runs there too: `--resume` keeps them (no step, no re-evaluation, files untouched) and rebuilds the
    compare from them, the seeds' best capsule copied from where it now lies."""
    args = ["compare", "--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields",
            "text", "--label-column", "y", "--label-words", "a= the", "b= a", "--quiet", "--eval-every", "1",
            "--methods", "capt", "zero-shot", "--seeds", "0", "1", "--max-steps", "2"]
    assert cli(args + ["--out", str(tmp_path / "a")]) == 0
    before = json.loads((tmp_path / "a" / "compare.json").read_text())
    shutil.move(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "capt" / "capsule")
    files = {p: p.read_bytes() for p in (tmp_path / "b" / "capt").rglob("seed-*/**/*") if p.is_file()}
    assert cli(args + ["--out", str(tmp_path / "b"), "--resume"]) == 0
    assert {p: p.read_bytes() for p in (tmp_path / "b" / "capt").rglob("seed-*/**/*") if p.is_file()} == files
    after = json.loads((tmp_path / "b" / "compare.json").read_text())
    assert after["rows"] == before["rows"]
    summary = json.loads((tmp_path / "b" / "capt" / "summary.json").read_text())
    assert summary["artifact"] == str(tmp_path / "b" / "capt" / "capsule")
    assert (tmp_path / "b" / "capt" / "capsule" / "capsule.safetensors").exists()
    assert all(r["config"]["out_dir"].startswith(str(tmp_path / "b")) for r in summary["runs"])


def test_a_new_run_into_a_used_folder_is_refused_and_loses_nothing(toy_csv, tmp_path, capsys):
    """A new run (no --resume) into a folder that holds one would append its steps to that run's log and
    replace its checkpoint and capsule: refused before anything trains, the files untouched. Several seeds
    and a compare check every folder they would write before the first run starts (a seed or method given
    twice is refused there too). An empty folder is fine."""
    def files(folder):
        return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    cfg = toy(toy_csv, tmp_path, max_steps=2, eval_every=1)
    train(cfg, progress=False)
    before = files(tmp_path / "run")
    with pytest.raises(capt.CaptError, match=r"run already holds a run \(checkpoint, metrics.jsonl, summary.json\); "
                                             r"a new run there would mix the two. Continue it with --resume"):
        train(cfg, progress=False)
    seeds = toy(toy_csv, tmp_path, max_steps=2, eval_every=1, out_dir=str(tmp_path / "seeds"))
    train_seeds(seeds, [0, 1], progress=False)
    with pytest.raises(capt.CaptError, match=r"seeds already holds a run \(summary.json\)"):
        train_seeds(seeds, [1, 2], progress=False)
    assert not (tmp_path / "seeds" / "seed-2").exists() and files(tmp_path / "run") == before
    args = ["compare", "--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields",
            "text", "--label-column", "y", "--label-words", "a= the", "b= a", "--quiet", "--eval-every", "1",
            "--max-steps", "2", "--out", str(tmp_path / "cmp")]
    assert cli(args + ["--methods", "zero-shot", "capt"]) == 0
    capsys.readouterr()
    assert cli(args + ["--methods", "linear-head", "capt"]) == 2
    assert f"{tmp_path / 'cmp'} already holds a run (compare.json)" in capsys.readouterr().err
    assert not (tmp_path / "cmp" / "linear-head").exists()
    (tmp_path / "empty").mkdir()
    assert train(replace(cfg, out_dir=str(tmp_path / "empty")), progress=False)["steps"] == 2
    # a seed or method given twice would be two runs in one folder: refused before the first one trains
    with pytest.raises(capt.CaptError, match=r"seed 0 given more than once \(\[0, 1, 0\]\); each seed is one run"):
        train_seeds(replace(cfg, out_dir=str(tmp_path / "twice")), [0, 1, 0], progress=False)
    assert cli(args[:-1] + [str(tmp_path / "twice"), "--methods", "capt", "zero-shot", "capt"]) == 2
    assert "method capt given more than once" in capsys.readouterr().err and not (tmp_path / "twice").exists()


def test_resume_refuses_a_run_with_other_settings_and_loses_nothing(toy_csv, tmp_path):
    """Resuming with a changed lr (or task, capsule option, ...) would silently continue a different run:
    refused with the differing settings named; the checkpoint is left as it was. The budget may change."""
    cfg = toy(toy_csv, tmp_path, max_steps=2, eval_every=1)
    train(cfg, progress=False)
    ckpt = tmp_path / "run" / "checkpoint"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(capt.CaptError, match=r"settings differ \(lr: checkpoint None, now 0\.5\).*new --out"):
        train(toy(toy_csv, tmp_path, max_steps=4, eval_every=1, lr=0.5), resume=True, progress=False)
    with pytest.raises(capt.CaptError, match=r"capsule: checkpoint \{\}, now \{'fusion': 'project'\}"):
        train(toy(toy_csv, tmp_path, max_steps=4, eval_every=1, capsule={"fusion": "project"}), resume=True,
              progress=False)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    more = train(toy(toy_csv, tmp_path, max_steps=4, eval_every=2, patience=3), resume=True, progress=False)
    assert more["steps"] == 4


def test_compare_resume_extends_every_method_from_its_own_checkpoint(toy_csv, tmp_path, capsys):
    """`compare --resume` with a larger --max-steps continues each trained method where it stopped (the
    flag used to be accepted and ignored in compare mode, silently restarting from step 0)."""
    args = ["compare", "--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields",
            "text", "--label-column", "y", "--label-words", "a= the", "b= a", "--quiet", "--eval-every", "1",
            "--methods", "capt", "linear-head", "zero-shot", "--out", str(tmp_path / "cmp")]
    assert cli(args + ["--max-steps", "2"]) == 0
    assert cli(args + ["--max-steps", "4", "--resume"]) == 0
    capsys.readouterr()
    for m in ("capt", "linear-head"):
        log = [json.loads(x) for x in (tmp_path / "cmp" / m / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log if r["kind"] == "step"] == [1, 2, 3, 4]
        assert json.loads((tmp_path / "cmp" / m / "summary.json").read_text())["steps"] == 4


def test_training_in_time_boxed_chunks_equals_one_run(toy_csv, tmp_path, training_clock):
    """train_in_chunks (ZeroGPU's way): each chunk's budget grows by chunk_seconds and every chunk after the
    first resumes; the chunks together give the capsule of one uninterrupted run, each step logged once."""
    straight = train(toy(toy_csv, tmp_path / "a", max_steps=8, eval_every=1), progress=False)
    calls, events = [], []

    def chunk(cfg, resume):
        calls.append((cfg.max_minutes, resume))
        return train(cfg, resume=resume, progress=False)
    cfg = toy(toy_csv, tmp_path / "b", max_steps=8, eval_every=1)
    summary = train_in_chunks(cfg, chunk, chunk_seconds=0.05, callback=events.append)
    assert summary["steps"] == 8 and summary["stopped_by"] == "max_steps" and summary["chunks"] == len(calls) > 1
    assert calls[0][1] is False and all(resume for _, resume in calls[1:])
    assert [m for m, _ in calls] == pytest.approx([k * 0.05 / 60 for k in range(1, len(calls) + 1)])
    assert len(events) == len(calls) - 1   # one note between chunks
    assert all(e["kind"] == "info" and e["text"].startswith(f"chunk {k} done at step ")
               for k, e in enumerate(events, 1))
    a = load_file(str(tmp_path / "a" / "run" / "checkpoint" / "state.safetensors"))
    b = load_file(str(tmp_path / "b" / "run" / "checkpoint" / "state.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a if k.startswith("param/"))
    assert straight["test"] == summary["test"]
    log = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "step"] == list(range(1, 9))


def test_a_chunked_runs_eta_counts_to_the_runs_end_not_the_chunks(toy_csv, tmp_path, training_clock):
    """On ZeroGPU a run is a series of time-boxed calls; its progress line's ETA is the run's, not the chunk's
    (which used to cap it: the countdown ended with every chunk). With a budget of its own, that caps it."""
    for budget, out in ((None, "a"), (0.01, "b")):   # 0.01 minutes = 0.6 s, more than a chunk
        steps = []

        def chunk(cfg, resume):
            keep = lambda e: steps.append((cfg.max_minutes, e)) if e["kind"] == "step" else None  # noqa: E731
            return train(cfg, resume=resume, progress=False, callback=keep)
        train_in_chunks(toy(toy_csv, tmp_path / out, max_steps=40, eval_every=10, max_minutes=budget), chunk,
                        chunk_seconds=0.2)
        assert len({b for b, _ in steps}) > 1 and steps[-1][1]["step"] <= 40
        # past the chunk's end (records round to 0.1 s, so by more than that)
        assert any(e["eta_s"] > b * 60 - e["elapsed_s"] + 0.15 for b, e in steps), steps[:3]
        if budget:
            assert all(e["eta_s"] <= budget * 60 - e["elapsed_s"] + 0.1 for _, e in steps)


def test_chunks_stop_at_the_runs_own_budget_or_a_stop(toy_csv, tmp_path):
    calls = []

    def chunk(cfg, resume):   # every chunk runs out of time
        calls.append(cfg.max_minutes)
        assert cfg.run_minutes == 1.25   # the ETA counts to the run's budget
        return {"stopped_by": "max_minutes", "steps": len(calls)}
    out = train_in_chunks(toy(toy_csv, tmp_path, max_minutes=1.25), chunk, chunk_seconds=30)
    assert calls == [0.5, 1.0, 1.25] and out["chunks"] == 3   # the last chunk gets what is left, then the run ends
    calls.clear()
    stopped = train_in_chunks(toy(toy_csv, tmp_path), lambda cfg, resume: calls.append(1) or {
        "stopped_by": "stop requested", "steps": 1}, chunk_seconds=30)
    assert stopped["chunks"] == 1 and calls == [1]
    with pytest.raises(capt.CaptError, match="chunk_seconds=0 must be positive"):
        train_in_chunks(toy(toy_csv, tmp_path), chunk, chunk_seconds=0)
    with pytest.raises(capt.CaptError, match="needs an out_dir"):
        train_in_chunks(toy(toy_csv, tmp_path, out_dir=None), chunk, chunk_seconds=30)


def test_several_seeds_are_averaged(toy_csv, tmp_path):
    summary = train_seeds(toy(toy_csv, tmp_path, max_steps=2), [0, 1], progress=False)
    assert summary["seeds"] == [0, 1] and len(summary["runs"]) == 2
    assert "accuracy_std" in summary["test"] and (tmp_path / "run" / "capsule" / "capsule.json").exists()
    assert (tmp_path / "run" / "seed-0" / "summary.json").exists()


def _count_forwards(monkeypatch, bb):
    """Rows of every backbone forward from now on (the list grows as the backbone runs)."""
    rows = []
    stack = bb.model.encoder if bb.encoder_decoder else bb.model.model   # what capt.capsule.run calls
    forward = stack.forward
    monkeypatch.setattr(stack, "forward", lambda *a, **k: rows.append(len(k["inputs_embeds"])) or forward(*a, **k))
    return rows


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_linear_head_runs_the_backbone_once_per_prompt_and_scores_as_without_its_cache(arch, monkeypatch):
    """The linear head's feature cache: the same scores and gradients as `score(..., head=)` on every call,
    and the backbone runs only on prompts it has not seen, each once (a repeat within a batch too)."""
    from capt.methods import LinearHeadMethod

    bb = tiny(arch)
    task = capt.get_task("cb")
    r = [task.render(e, bb.style) for e in capt.load_examples(task, "val", limit=10)]
    cached, plain = LinearHeadMethod(bb, task, seed=3), LinearHeadMethod(bb, task, seed=3, cache=False)
    rows = _count_forwards(monkeypatch, bb)
    for batch, new in ((r[:4], [4]), (r[2:6] + r[2:3], [2]), (r[:6], []), (r[6:10] + r[7:8], [4]), (r, [])):
        before = len(rows)
        got = cached.scores(batch)
        assert rows[before:] == new
        want = plain.scores(batch)
        assert rows[before + len(new):] == [len(batch)]   # without the cache: the whole batch, every call
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
        assert got.dropped == want.dropped
        for m, out in ((cached, got), (plain, want)):
            m.head.zero_grad()
            out.logits.sum().backward()
        torch.testing.assert_close(cached.head.weight.grad, plain.head.weight.grad, rtol=1e-5, atol=1e-6)
        assert cached.head.weight.grad.abs().sum() > 0
    assert len(cached.cache) == 10


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_a_linear_head_sees_copas_alternatives(arch):
    """COPA's alternatives are the example's own text: a d x C head on the last token must read them, or it
    can only guess from the premise. Changing one alternative changes what the linear-head baseline and a
    CaPT capsule with head='linear' score (and the baseline's cache keeps the two apart)."""
    from capt.methods import LinearHeadMethod

    from conftest import random_capsule

    bb, task = tiny(arch), capt.get_task("copa")
    example = dict(premise="The man turned on the faucet.", choice1="The toilet filled with water.",
                   choice2="Water flowed from the spout.", question="effect", label=1)
    swapped = {**example, "choice2": "The faucet rusted away."}
    pair = [task.render(e, bb.style) for e in (example, swapped)]
    assert pair[0].prompt == pair[1].prompt or bb.encoder_decoder     # the LM prompt is the premise alone
    feats = capt.scoring.head_states(bb, None, pair)[0]
    assert not torch.allclose(feats[0], feats[1])
    method = LinearHeadMethod(bb, task, seed=0)
    logits = method.scores(pair).logits
    assert len(method.cache) == 2 and not torch.allclose(logits[0], logits[1])
    capsule = random_capsule(bb, head="linear")
    logits = capt.score(bb, capsule, pair).logits
    assert not torch.allclose(logits[0], logits[1])


def test_linear_head_training_with_its_cache_equals_training_without(toy_csv, tmp_path, monkeypatch):
    """A linear-head run of several epochs with dev evaluations: the cache leaves the losses, dev scores, test
    metrics and trained head as they are, and the backbone runs once per distinct prompt."""
    import capt.methods

    bb = tiny("tiny-llama")
    cfg = dict(method="linear-head", max_steps=30, eval_every=5, lr=0.05)
    rows = _count_forwards(monkeypatch, bb)
    a = train(toy(toy_csv, tmp_path / "a", **cfg), bb, progress=False)
    seen = sum(rows)

    class Plain(capt.methods.LinearHeadMethod):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw, cache=False)

    monkeypatch.setattr(capt.methods, "LinearHeadMethod", Plain)
    b = train(toy(toy_csv, tmp_path / "b", **cfg), bb, progress=False)
    assert a["steps"] == b["steps"] == 30 and a["test"] == b["test"]
    logs = [[json.loads(x) for x in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    got, want = ([rec["loss"] for rec in log if rec["kind"] == "step"] for log in logs)
    assert len(got) == 30 and got == pytest.approx(want, rel=1e-5) and got[-1] < got[0] / 2
    got, want = ([rec["dev"] for rec in log if rec["kind"] == "eval"] for log in logs)
    assert len(got) == 6 and got == want
    assert seen == 40   # the file's 40 distinct prompts (train, dev and test), each once
    assert sum(rows) - seen > 30 * 4   # without the cache: every step's batch of 4, and more for dev and test
    heads = [load_file(str(tmp_path / d / "run" / "checkpoint" / "state.safetensors")) for d in "ab"]
    keys = [k for k in heads[0] if k.startswith("param/head.")]
    assert len(keys) == 2 and all(torch.allclose(heads[0][k], heads[1][k], atol=1e-6) for k in keys)


def test_compare_gives_one_row_per_method(toy_csv, tmp_path):
    rows = compare(toy(toy_csv, tmp_path, max_steps=2), ["capt", "zero-shot", "majority", "linear-head"],
                   progress=False)
    assert [r["method"] for r in rows] == ["capt", "zero-shot", "majority", "linear-head"]
    table = format_table(rows)
    assert table.count("\n") == 5 and "| capt | 128 |" in table
    assert json.loads((tmp_path / "run" / "compare.json").read_text())["rows"] == rows


def test_cli_runs_and_prints_a_summary(toy_csv, tmp_path, capsys):
    code = cli(["--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields", "text",
                "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "2", "--quiet",
                "--out", str(tmp_path / "cli"), "--fusion", "project", "--layers", "0,2"])
    assert code == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert out["method"] == "capt" and out["n_trainable"] == 2 * 32 + 2 * 2 * 32 * 8
    assert out["steps"] == 2 and out["stopped_by"] == "max_steps"
    assert out["artifact"] == str(tmp_path / "cli" / "capsule")
    # the same outcome in one line for people, on stderr (stdout stays JSON)
    line = printed.err.strip().splitlines()[-1]
    assert line.startswith("capt on toy (tiny-llama): test accuracy ")
    assert f"test accuracy {100 * out['test']['accuracy']:.1f} %" in line
    assert f"2 steps (max_steps), kept step {out['best_step']}" in line and f"saved to {out['artifact']}" in line
    # without --out nothing is kept, and the line says so
    assert cli(["--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields", "text",
                "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "1", "--quiet"]) == 0
    printed = capsys.readouterr()
    assert "artifact" not in json.loads(printed.out)
    assert printed.err.strip().endswith("nothing saved: give --out to keep the run and what it trained")
    assert printed.err.startswith("note: no --out, so nothing this run trains will be saved")


@pytest.mark.parametrize("args, message", [
    (["--task", "nope"], "unknown task 'nope'"),
    (["--method", "lora"], "unknown method 'lora'"),
    (["--lr", "-1"], "lr=-1.0 is out of range"),
    (["--max-steps", "0"], "max_steps=0 is out of range"),
    (["--fusion", "sum"], "fusion='sum' is not valid"),
    (["--layers", "0,x"], "layers='0,x' is not valid"),
    (["--data-file", "x.csv"], "needs fields"),
    # an option nothing in the run would use is refused, not silently ignored
    (["--task", "cb", "--label-words", "0=yes", "1=no"], "--label-words applies only with --data-file (your own "
                                                          "CSV/JSONL file); the built-in task 'cb' has its own"),
    (["--fields", "text", "--label-column", "y"], "--fields, --label-column apply only with --data-file"),
    (["--num-virtual-tokens", "5"], "--num-virtual-tokens is used by prompt-tuning and p-tuning-v2 only: method "
                                    "capt would ignore it"),
    (["--method", "deep-prompt-1", "--fusion", "project"], "--fusion is used by capt only: method deep-prompt-1"),
    (["--method", "linear-head", "--head", "linear", "--layers", "odd"],
     "--layers is used by capt and deep-prompt-1 only; --head is used by capt and deep-prompt-1 only: method "
     "linear-head would ignore them"),
    (["compare", "--methods", "capt", "--test-file", "t.csv"], "--test-file applies only with --data-file"),
])
def test_bad_input_fails_before_training_with_a_clear_message(args, message, capsys, tmp_path):
    head = ["compare"] if args[:1] == ["compare"] else []
    code = cli(head + ["--backbone", "tiny-llama", "--out", str(tmp_path / "r")] + args[len(head):])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_options_a_method_uses_are_accepted(toy_csv, tmp_path, capsys):
    """The other side of the refusals above: each option where its method uses it, and compare, which runs
    every method at one set of options, takes capsule options beside baselines that ignore them."""
    data = ["--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields", "text",
            "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "1", "--quiet"]
    assert cli(data + ["--method", "deep-prompt-1", "--layers", "odd", "--head", "linear"]) == 0
    assert json.loads(capsys.readouterr().out)["n_trainable"] == 2 * 32 + (32 * 2 + 2)   # 2 of 4 layers; d x C head
    assert cli(data + ["--method", "prompt-tuning", "--num-virtual-tokens", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["n_trainable"] == 3 * 32
    assert cli(["compare", *data, "--methods", "linear-head", "majority", "--fusion", "project"]) == 0


def test_bad_data_files_are_refused(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("text,y\nhello,a\nworld,zzz\n")
    cfg = TrainConfig(task="toy", backbone="tiny-llama", data_file=str(bad), fields=["text"], label_column="y",
                      label_words={"a": " the", "b": " a"})
    with pytest.raises(capt.CaptError, match="zzz"):
        train(cfg, progress=False)
    cfg = TrainConfig(task="toy", backbone="tiny-llama", data_file=str(bad), fields=["review"], label_column="y",
                      label_words={"a": " the", "b": " a"})
    with pytest.raises(capt.CaptError, match="review"):
        train(cfg, progress=False)


def test_compare_cli_then_model_card(toy_csv, tmp_path, capsys):
    import train.card as card_module
    from train.card import main as card

    run = tmp_path / "cmp"
    code = cli(["compare", "--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields",
                "text", "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "2", "--quiet",
                "--methods", "capt", "zero-shot", "majority", "--out", str(run)])
    assert code == 0 and "| majority |" in capsys.readouterr().out
    assert json.loads((run / "compare.json").read_text())["command"].startswith("python -m train compare")
    assert card([str(run), "--to", str(tmp_path / "shipped" / "toy")]) == 0
    shipped = tmp_path / "shipped" / "toy"
    text = (shipped / "README.md").read_text()
    assert "python -m train compare" in text and "| zero-shot |" in text and "| majority |" in text
    answered = {m: json.loads((run / m / "summary.json").read_text())["test_counts"]
                for m in ("capt", "zero-shot")}
    line = next(x for x in text.splitlines() if x.startswith("- What each method answered on the "))
    for m, c in answered.items():   # gold (how many) -> predicted, as the run counted; majority left out
        (g, x), (h, y) = c.items()   # the custom task's labels are its words, 'the' and 'a'
        assert (f"{m}: {g} ({sum(x.values())}) → {x[g]} {g}, {x[h]} {h}; "
                f"{h} ({sum(y.values())}) → {y[g]} {g}, {y[h]} {h}") in line
    assert "majority" not in line and "seed" not in line   # one seed: no seed named
    kept = json.loads((shipped / "results.json").read_text())["test_counts"]
    assert kept == {m: {"seed": None, "counts": c} for m, c in answered.items()}
    code = json.loads((run / "capt" / "summary.json").read_text())["code"]
    where = f"commit {code['commit'][:10]}" if code["commit"] else "outside a git checkout"
    assert f"- Code: capt {capt.__version__} ({where}" in text and f"torch threads: {code['threads']}." in text
    assert card_module.REPRODUCE in text   # bit for bit: same code, threads and kind of CPU
    m = code["machine"]   # the machine that trained, as the run recorded it
    assert f"s of training on {m['cores']} CPU cores ({m['cpu']}, {m['isa']}), torch {code['torch']}, no GPU." in text
    capsule, task = capt.load_capsule(shipped, tiny("tiny-llama"))
    assert task.name == "toy"
    capsys.readouterr()
    assert card([str(tmp_path / "shipped"), "--table"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| task | metric | capt | capt, seeds | zero-shot | majority |")
    assert "| toy | accuracy | " in table and " | - | " in table   # one seed, no seeds run: no mean


def test_card_shows_an_absolute_out_inside_the_checkout_as_a_relative_path():
    """A run made from a git worktree records the main checkout's absolute --out; the card shows what a reader
    types from the checkout's root, and leaves any other command exactly as recorded."""
    import shlex
    from train.card import ROOT, shown_command

    out = shlex.quote(str(ROOT / "runs" / "cb x"))
    recorded = f"python -m train compare --task cb --seeds 0 1 --quiet --out {out} --resume"
    assert shown_command(recorded) == "python -m train compare --task cb --seeds 0 1 --quiet --out 'runs/cb x' --resume"
    elsewhere = "python -m train --task cb --out /tmp/cb-run --max-steps 3"
    assert shown_command(elsewhere) == elsewhere
    relative = "python -m train --task 'my task' --out runs/x"
    assert shown_command(relative) == relative
    assert shown_command("(command not recorded)") == "(command not recorded)"


def test_card_notes_name_a_short_budget_only_when_there_was_one():
    """A trained baseline ahead of CaPT is reported either way; 'budget' is said only of a capped run."""
    from train.card import _notes

    rows = [{"method": "capt", "test_accuracy": 0.5}, {"method": "linear-head", "test_accuracy": 0.6},
            {"method": "zero-shot", "test_accuracy": 0.7}]
    summary = {"n_test": 50}
    capped = _notes(rows, "test_accuracy", {"seed": 0, "max_steps": 100}, summary, [])
    assert "At this budget linear-head (60.0) scored higher than CaPT (50.0)." in capped
    assert "same short budget (100 steps" in capped
    full = _notes(rows, "test_accuracy", {"seed": 0, "max_steps": None, "max_minutes": None}, summary, [])
    assert "At these settings linear-head (60.0) scored higher than CaPT (50.0)." in full
    assert "budget" not in full and "zero-shot (" not in full   # only trained methods are listed as ahead


def test_model_card_of_a_several_seed_compare(toy_csv, tmp_path, capsys):
    """With --seeds the card's table gives mean ± std per method, ships the seed best on dev and says so."""
    from train.card import main as card

    run = tmp_path / "cmp"
    assert cli(["compare", "--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields",
                "text", "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "3", "--eval-every",
                "1", "--quiet", "--methods", "capt", "majority", "--seeds", "0", "1", "2", "--out", str(run)]) == 0
    printed = capsys.readouterr().out
    capt_summary = json.loads((run / "capt" / "summary.json").read_text())
    mean, std = capt_summary["test"]["accuracy"], capt_summary["test"]["accuracy_std"]
    assert "| capt | 128 | 0.0000 |" not in printed and f"{100 * mean:.1f} ± {100 * std:.1f} |" in printed
    assert re.search(r"^\| majority \| 0 \| 0\.0000 \| 0 \| [\d.]+ \|$", printed, re.M)   # untrained: no ±
    assert card([str(run), "--to", str(tmp_path / "shipped")]) == 0
    text = (tmp_path / "shipped" / "README.md").read_text()
    best = capt_summary["best_seed"]
    shipped = next(r for r in capt_summary["runs"] if r["config"]["seed"] == best)
    assert max(r["dev"]["accuracy"] for r in capt_summary["runs"]) == shipped["dev"]["accuracy"]
    assert "| capt | 128 | " in text and f"| 3 | {100 * mean:.1f} ± {100 * std:.1f} |" in text
    assert re.search(r"\| majority \| 0 \| 0 \| 0 \| [\d.]+ \|", text)   # untrained: the same every seed, no ±
    assert "CaPT beats majority class on this split" in text or "CaPT does NOT beat majority" in text
    assert f"Seeds 0, 1, 2 trained alike; shipped: seed {best}, the best on dev" in text
    assert f"which scored {100 * shipped['test']['accuracy']:.1f} on test" in text and "One seed" not in text
    saved = json.loads((tmp_path / "shipped" / "capsule.json").read_text())
    assert saved["metrics"] == shipped["test"] and saved["training"]["config"]["seed"] == best
    runs = capt_summary["runs"]   # every seed of every trained method, with how many beat each reference
    majority = json.loads((run / "majority" / "summary.json").read_text())["test"]["accuracy"]
    scores = " | ".join(f"{100 * r['test']['accuracy']:.1f}" for r in runs)
    above = sum(r["test"]["accuracy"] > majority for r in runs)
    assert "| method | metric | seed 0 | seed 1 | seed 2 | seeds above majority class |" in text
    assert f"| capt | accuracy | {scores} | {above} of 3 ({100 * majority:.1f}) |" in text
    assert f"Best dev at steps: capt {', '.join(str(r['best_step']) for r in runs)}." in text
    kept = json.loads((tmp_path / "shipped" / "results.json").read_text())["seed_runs"]
    assert list(kept) == ["capt"] and [r["seed"] for r in kept["capt"]] == [0, 1, 2]
    (g, x), _ = shipped["test_counts"].items()
    assert (f"(several seeds: the seed best on dev). capt, seed {best} (shipped): {g} ({sum(x.values())}) → "
            + ", ".join(f"{n} {p}" for p, n in x.items()) + ";") in text
    assert [r["test"] for r in kept["capt"]] == [r["test"] for r in runs]


def test_model_card_with_a_seeds_run(toy_csv, tmp_path, capsys):
    """--seeds: a several-seed CaPT-alone run at the compare's settings goes into the card (every seed, the mean,
    how many seeds pass each reference, seed 0 bit for bit the compare's capsule) and into the table's seeds
    column; a run trained otherwise, or one without its command, is refused and nothing is written."""
    from train.card import main as card

    common = ["--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields", "text",
              "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "3", "--eval-every", "1",
              "--quiet"]
    run, seeds, shipped = tmp_path / "cmp", tmp_path / "seeds", tmp_path / "shipped" / "toy"
    assert cli(["compare", *common, "--methods", "capt", "majority", "--out", str(run)]) == 0
    assert cli([*common, "--seeds", "0", "1", "--out", str(seeds)]) == 0
    rec = json.loads((seeds / "summary.json").read_text())
    assert rec["command"] == "python -m train " + " ".join(common).replace("a= the", "'a= the'").replace(
        "b= a", "'b= a'") + f" --seeds 0 1 --out {seeds}"
    assert card([str(run), "--to", str(shipped), "--seeds", str(seeds)]) == 0
    text = (shipped / "README.md").read_text()
    per = ", ".join(f"{100 * r['test']['accuracy']:.1f}" for r in rec["runs"])
    mean, std = rec["test"]["accuracy"], rec["test"]["accuracy_std"]
    results = json.loads((shipped / "results.json").read_text())
    majority = next(r["test_accuracy"] for r in results["rows"] if r["method"] == "majority")
    above = sum(r["test"]["accuracy"] > majority for r in rec["runs"])
    assert f"- Seeds 0, 1, CaPT alone, same settings ({rec['command']}" in text
    assert f"test accuracy {per}, mean {100 * mean:.1f} ± {100 * std:.1f} (best dev at steps" in text
    assert f"on accuracy, {above} of 2 above majority class's {100 * majority:.1f}." in text
    assert "Seed 0 reproduced the shipped capsule bit for bit." in text and "One seed (0)." in text
    assert results["capt_seeds"]["reproduces_shipped"] is True
    capsys.readouterr()
    assert card([str(tmp_path / "shipped"), "--table"]) == 0
    table = capsys.readouterr().out
    assert "| capt | capt, seeds | zero-shot |" in table and f"| {100 * mean:.1f} ± {100 * std:.1f} (2) |" in table

    before = (shipped / "README.md").read_text()
    other = tmp_path / "other"
    assert cli([*common, "--lr", "0.1", "--seeds", "0", "1", "--out", str(other)]) == 0
    assert card([str(run), "--to", str(shipped), "--seeds", str(other)]) == 2
    assert "was not trained like the compare's CaPT run: lr 0.1 there, None in the compare" in capsys.readouterr().err
    summary = json.loads((seeds / "summary.json").read_text())
    del summary["command"]
    (seeds / "summary.json").write_text(json.dumps(summary))
    assert card([str(run), "--to", str(shipped), "--seeds", str(seeds)]) == 2
    assert "records no command" in capsys.readouterr().err
    assert (shipped / "README.md").read_text() == before
    for r in summary["runs"]:      # as written before min_steps existed: that run did what its default does
        del r["config"]["min_steps"]
    (seeds / "summary.json").write_text(json.dumps({**summary, "command": rec["command"]}))
    assert card([str(run), "--to", str(shipped), "--seeds", str(seeds)]) == 0
    assert cli([*common, "--min-steps", "2", "--seeds", "0", "1", "--out", str(tmp_path / "held")]) == 0
    capsys.readouterr()
    assert card([str(run), "--to", str(shipped), "--seeds", str(tmp_path / "held")]) == 2
    assert "min_steps 2 there, 0 in the compare" in capsys.readouterr().err


def test_model_card_amended_with_baseline_seeds(toy_csv, tmp_path, capsys):
    """--baseline-seeds: a compare of the baselines alone on other seeds, at the shipped one-seed compare's
    settings, adds every seed's score to the card and the mean ± std over them and the compare's own seed to
    results.json and the README table; its run folder is not needed. A run made otherwise, one with CaPT in it,
    one repeating the compare's seed, or a second amendment is refused, and nothing is written."""
    from train.card import main as card

    common = ["--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv), "--fields", "text",
              "--label-column", "y", "--label-words", "a= the", "b= a", "--max-steps", "3", "--eval-every", "1",
              "--quiet"]
    run, added, shipped = tmp_path / "cmp", tmp_path / "added", tmp_path / "shipped" / "toy"
    assert cli(["compare", *common, "--methods", "capt", "majority", "linear-head", "--out", str(run)]) == 0
    assert card([str(run), "--to", str(shipped)]) == 0
    shutil.rmtree(run)   # a shipped card outlives its run folder
    assert cli(["compare", *common, "--methods", "linear-head", "--seeds", "1", "2", "--out", str(added)]) == 0
    before = (shipped / "README.md").read_text()
    capsys.readouterr()
    assert card([str(shipped), "--baseline-seeds", str(added)]) == 0
    assert "added seeds 1, 2 of linear-head" in capsys.readouterr().out

    results = json.loads((shipped / "results.json").read_text())
    rec = results["baseline_seeds"]
    row = next(r for r in results["rows"] if r["method"] == "linear-head")
    runs = json.loads((added / "linear-head" / "summary.json").read_text())["runs"]
    scores = [row["test_accuracy"]] + [r["test"]["accuracy"] for r in runs]
    mean = sum(scores) / 3
    std = (sum((x - mean) ** 2 for x in scores) / 3) ** 0.5
    assert rec["seeds"] == [0, 1, 2] and [r["seed"] for r in rec["methods"]["linear-head"]["runs"]] == [0, 1, 2]
    assert rec["methods"]["linear-head"]["test"]["accuracy"] == pytest.approx(mean)
    assert rec["methods"]["linear-head"]["test"]["accuracy_std"] == pytest.approx(std)
    assert rec["command"].startswith("python -m train compare") and rec["commit"] == runs[0]["code"]["commit"]
    text = (shipped / "README.md").read_text()
    majority = next(r["test_accuracy"] for r in results["rows"] if r["method"] == "majority")
    above = sum(x > majority for x in scores)
    assert text.startswith(before.split("\n\nMetrics are percentages")[0])   # the card above stays as it was
    assert "- Baselines, seeds 0, 1, 2: seed 0 is the table above; seeds 1, 2 were added" in text
    assert (f"linear-head: accuracy {', '.join(f'{100 * x:.1f}' for x in scores)}, mean {100 * mean:.1f} ± "
            f"{100 * std:.1f}") in text and f"{above} of 3 above majority class's {100 * majority:.1f}" in text
    seconds = json.loads((added / "linear-head" / "summary.json").read_text())["train_seconds"]
    assert f"; the added seeds trained in {seconds:,.0f} s)" in text
    assert text.endswith(before[before.index("\n\nMetrics are percentages"):])
    assert capt.load_capsule(shipped, tiny("tiny-llama"))[1].name == "toy"   # the capsule files came along
    capsys.readouterr()
    assert card([str(tmp_path / "shipped"), "--table"]) == 0
    assert f"| {100 * mean:.1f} ± {100 * std:.1f} (3) |" in capsys.readouterr().out

    amended = (shipped / "README.md").read_text()
    assert card([str(shipped), "--baseline-seeds", str(added)]) == 2
    assert "already has baselines' seeds" in capsys.readouterr().err
    results.pop("baseline_seeds")
    (shipped / "results.json").write_text(json.dumps(results))
    for bad, why in ((["--lr", "0.5", "--methods", "linear-head", "--seeds", "1"], "lr 0.5 there, None in the compare"),
                     (["--methods", "capt", "--seeds", "1"], "it may hold only the compare's trained baselines"),
                     (["--methods", "linear-head", "--seeds", "0", "1"], "seed 0, the compare's own")):
        other = tmp_path / f"other-{len(why)}"
        assert cli(["compare", *common, *bad, "--out", str(other)]) == 0
        assert card([str(shipped), "--baseline-seeds", str(other)]) == 2
        assert why in capsys.readouterr().err
    assert (shipped / "README.md").read_text() == amended   # nothing written by a refused amendment


def test_readme_results_table_is_the_shipped_capsules_own():
    """The README's cross-task table is exactly what `train.card --table` reads from the shipped cards'
    results.json files: a capsule retrained without updating the README fails here."""
    from pathlib import Path

    from train.card import results_table

    root = Path(__file__).resolve().parent.parent
    table = results_table(root / "capsules" / "smollm2-135m").strip()
    assert table.count("\n") == 7 and table in (root / "README.md").read_text()


@pytest.mark.parametrize("command, budget", [
    ("python -m train compare --task cb --max-steps 100 --seeds 0 1 2", "100 steps"),
    ("python -m train compare --task rte --max-minutes 12 --quiet", "12 min"),
    ("python -m train compare --task copa --seeds 0 1 2 --quiet", "early stopping, ≤ 50 epochs"),
    ("python -m train compare --task copa --epochs 20", "early stopping, ≤ 20 epochs"),
])
def test_the_table_names_each_compares_budget(command, budget):
    """The README table's budget column, read from the compare's command: a step or minute cap, else the
    paper's protocol (early stopping within the epochs the CLI ran, 50 by default)."""
    from train.card import _budget

    assert _budget({"command": command}) == budget


def test_two_processes_under_accelerate_launch(toy_csv, tmp_path):
    """The unchanged CLI under `accelerate launch` (2 CPU processes, gloo): batches sharded, gradients
    averaged, both processes take the same steps and finish."""
    import os
    import subprocess
    import sys

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "train", "--backbone", "tiny-llama", "--task", "toy", "--data-file", str(toy_csv),
           "--fields", "text", "--label-column", "y", "--label-words", "a= the", "b= a",
           "--max-steps", "4", "--eval-every", "2", "--quiet", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    capt.load_capsule(out / "capsule", tiny("tiny-llama"))


def test_probe_cli_prints_and_saves_the_librarys_result(tmp_path, capsys):
    import re

    from capt.analysis import probe_on_val

    bb, cb = capt.load_backbone("tiny-llama"), capt.get_task("cb")
    cap = capt.Capsule.for_backbone(bb, capt.CapsuleConfig(fusion="none", init_std=0.5), seed=0)
    capt.save_capsule(cap, tmp_path / "cap", bb, cb)
    args = ["probe", "--capsule", str(tmp_path / "cap"), "--n-examples", "6",   # its backbone and task by default
            "--ks", "2", "1", "--json", str(tmp_path / "p.json")]
    assert cli(args) == 0
    out = capsys.readouterr().out
    expected = probe_on_val(bb, cb, cap, n_examples=6, ks=(1, 2), seed=0)   # the task comes from the capsule
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([+-][\d.]+) \|$", out, re.M)
    assert [(int(k), float(a)) for k, a, _ in rows] == [(k, round(100 * a, 1)) for k, a in expected.accuracy.items()]
    assert out.startswith("cb: 6 val examples (seed 0)") and "deep prompt" in out
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["accuracy"] == {str(k): a for k, a in expected.accuracy.items()}
    assert saved["command"] == "python -m train probe " + " ".join(args[1:]) and saved["backbone"] == "tiny-llama"
    for bad, message in [([], "give --capsule, --task, or both"),
                         (["--task", "cb", "--ks", "0"], "pooled tokens in 1..64"),
                         (["--task", "cb", "--n-examples", "2"], "sample size 2 is out of range")]:
        assert cli(["probe", "--backbone", "tiny-llama", *bad]) == 2
        assert message in capsys.readouterr().err
    capt.save_capsule(cap, tmp_path / "bare", bb)   # saved without a task
    assert cli(["probe", "--capsule", str(tmp_path / "bare")]) == 2
    assert "was saved without a task; give --task (one of boolq, cb" in capsys.readouterr().err


def test_min_steps_holds_off_early_stopping_and_a_resume_may_raise_it(toy_csv, tmp_path):
    """No early stopping before min_steps (CaPT can sit near chance on dev for a few hundred steps): a run
    whose dev never improves after step 1 stops at step 2 with patience 1, at step 5 with min_steps 5, still
    keeping step 1. A run that stopped early, resumed with a larger min_steps, trains on to the same place."""
    kw = dict(max_steps=30, eval_every=1, patience=1, lr=1e-6)   # a tiny lr: dev never improves after step 1
    first = train(toy(toy_csv, tmp_path / "a", **kw), progress=False)
    assert first["stopped_by"] == "early stopping" and first["steps"] == 2
    held = train(toy(toy_csv, tmp_path / "b", min_steps=5, **kw), progress=False)
    assert held["stopped_by"] == "early stopping" and held["steps"] == 5 and held["best_step"] == 1
    more = train(toy(toy_csv, tmp_path / "a", min_steps=5, **kw), resume=True, progress=False)
    assert (more["steps"], more["best_step"], more["test"]) == (5, 1, held["test"])
    log = [json.loads(x) for x in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "step"] == [1, 2, 3, 4, 5]
    with pytest.raises(capt.CaptError, match=r"min_steps=-1 is out of range; valid: an integer 0\.\."):
        toy(toy_csv, tmp_path, min_steps=-1)


@pytest.mark.parametrize("extra, stop", [({}, 6), ({"min_steps": 9}, 10), ({"max_steps": 5}, None)])
def test_each_step_says_where_early_stopping_would_end_the_run(toy_csv, tmp_path, extra, stop):
    """A step record names the step at which early stopping ends the run unless dev improves (None: the run
    reaches its last step first), and the progress line says it. Dev never improves after the first evaluation
    here, so every record from step 1 on names the step the run did stop at: 2 + patience 2 × every 2 = 6; not
    before min_steps 9 (the evaluation at 10); none when max_steps 5 ends the run first."""
    events, curves = [], viz.TrainingCurves()
    cfg = toy(toy_csv, tmp_path, **{"max_steps": 30, "eval_every": 2, "patience": 2, "lr": 1e-6, **extra})
    summary = train(cfg, callback=events.append, progress=False)
    steps = [e for e in events if e["kind"] == "step"]
    evals = [e["improved"] for e in events if e["kind"] == "eval"]
    assert evals == [True] + [False] * (len(evals) - 1)
    assert summary["best_step"] == 2 and summary["steps"] == (stop or 5)
    assert summary["stopped_by"] == ("early stopping" if stop else "max_steps")
    assert [e["early_stop_step"] for e in steps] == [stop] * len(steps)
    assert all((e["early_stop_eta_s"] is None) == (stop is None) for e in steps)
    assert all(e["early_stop_eta_s"] is None or 0 <= e["early_stop_eta_s"] <= e["eta_s"] for e in steps)
    curves.add(steps[0])
    assert (f"(early stopping at step {stop}, in " in curves.text) == (stop is not None), curves.text


def test_a_finished_run_saved_before_a_setting_existed_is_kept(toy_csv, tmp_path):
    """A summary.json written before a TrainConfig field existed (min_steps) lacks it; that run did what the
    default does, so `--resume` keeps it as finished (no step, files untouched), and train.card's check of a
    seeds run against its compare reads it the same way. Another value of the new setting is another run."""
    cfg = toy(toy_csv, tmp_path, max_steps=2, eval_every=1)
    first = train(cfg, progress=False)
    path = tmp_path / "run" / "summary.json"
    saved = json.loads(path.read_text())
    del saved["config"]["min_steps"]
    path.write_text(json.dumps(saved))
    files = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert train(cfg, resume=True, progress=False)["test"] == first["test"]
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == files
    assert saved_config(saved["config"]) == json.loads(json.dumps(asdict(cfg)))
    assert _finished_run(replace(cfg, min_steps=4)) is None and _finished_run(cfg)["test"] == first["test"]


def test_resume_of_a_run_that_stopped_early_stays_stopped(toy_csv, tmp_path):
    """A run killed after its early-stopping checkpoint (before its summary) resumes to the run it was: no
    step past the stop. Resumed with its summary there and the same settings, it is returned as saved (the
    log and files untouched); with a larger patience it trains on, as an uninterrupted run would."""
    kw = dict(max_steps=30, eval_every=1, patience=1, lr=1e-6)   # a tiny lr: dev never improves after step 1
    straight = train(toy(toy_csv, tmp_path / "a", **kw), progress=False)
    assert straight["stopped_by"] == "early stopping" and straight["steps"] == 2
    cfg = toy(toy_csv, tmp_path / "b", **kw)
    train(cfg, progress=False)
    run = tmp_path / "b" / "run"
    (run / "summary.json").unlink()          # as if killed between the last checkpoint and the summary
    resumed = train(cfg, resume=True, progress=False)
    assert resumed["steps"] == 2 and resumed["stopped_by"] == "early stopping"
    assert resumed["test"] == straight["test"] and resumed["train_seconds"] <= straight["train_seconds"] + 5
    log = (run / "metrics.jsonl").read_text()
    files = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    events = []
    again = train(cfg, callback=events.append, resume=True, progress=False)
    assert again == json.loads((run / "summary.json").read_text()) and events[-1]["kind"] == "done"
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
    assert (run / "metrics.jsonl").read_text() == log
    more = train(toy(toy_csv, tmp_path / "b", **dict(kw, patience=3)), resume=True, progress=False)
    assert more["steps"] == 4 and more["stopped_by"] == "early stopping"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "step"]
    assert steps == [1, 2, 3, 4]
