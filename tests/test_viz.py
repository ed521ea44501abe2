"""capt.viz formatting that the app and the CLI share."""
from capt import viz


def test_runs_table_rows_come_from_run_summaries():
    summary = {"task": "cb", "method": "capt", "backbone": "tiny-llama", "n_trainable": 17280, "steps": 20,
               "train_seconds": 12.4, "n_test": 56, "test": {"accuracy": 0.5714, "macro_f1": 0.4}, "config": {}}
    row = viz.run_row(summary, "12:00:00")
    assert row["test"] == "accuracy 57.1 % · macro_f1 40.0 %" and "config" not in row
    table = viz.runs_table([row, {**row, "method": "linear-head"}])
    lines = table.splitlines()
    assert lines[2].startswith("| time | task | method |") and len(lines) == 6
    assert lines[4] == ("| 12:00:00 | cb | capt | tiny-llama | 17,280 | 20 | 12 | 56 | "
                        "accuracy 57.1 % · macro_f1 40.0 % |  |")                 # no counts: no one-label bar
    assert "| linear-head |" in lines[5]
    assert viz.runs_table([]) == ""
    counts = {"contradiction": {"contradiction": 20, "entailment": 8}, "entailment": {"entailment": 23},
              "neutral": {"entailment": 5}}
    row = viz.run_row({**summary, "test_counts": counts}, "12:01:00")
    assert row["bar"] == "'contradiction' 50.0 %"                                # 28 of 56
    assert viz.runs_table([row]).splitlines()[-1].endswith("| 'contradiction' 50.0 % |")
    assert viz.run_row({**summary, "test": {"f1a": 0.4}, "test_counts": counts})["bar"] == ""   # accuracy only
    old_row = {k: v for k, v in viz.run_row(summary).items() if k != "bar"}     # a row kept from before the column
    assert viz.runs_table([old_row]).splitlines()[-1].endswith("macro_f1 40.0 % |  |")


def test_done_message_says_what_the_run_answered_and_what_one_label_everywhere_scores():
    counts = {"True": {"True": 561, "False": 22}, "False": {"True": 381, "False": 17}}   # BoolQ-like: 'True' mostly
    summary = {"stopped_by": "early stopping", "steps": 1200, "train_seconds": 5082.0, "best_step": 700,
               "n_test": 981, "test": {"accuracy": 578 / 981}, "n_trainable": 17280, "backbone_params": 134515008,
               "data": "full splits", "test_counts": counts}
    text = viz.summary_markdown(summary)
    assert text.startswith("**Done** (early stopping): 1200 steps in 5082 s, best dev at step 700.")
    assert ("What it answered on the test split, gold label (how many) → answers: True (583) → 561 True, 22 False; "
            "False (398) → 381 True, 17 False.") in text
    assert text.endswith(" Always answering 'True' would score 59.4 % accuracy here.")   # 583 / 981
    assert "Always answering" not in viz.summary_markdown({**summary, "test": {"f1a": 0.4}})   # accuracy only
    assert viz.summary_markdown({k: v for k, v in summary.items() if k != "test_counts"}).endswith("full splits.")


def test_watch_runs_the_job_in_the_callers_context_and_reports_its_events():
    """TrainingCurves.watch: the job sees the caller's context variables (ZeroGPU reads the Gradio request, hence
    whose quota, from one), its step events feed the curves, and an exception ends the run as an error event."""
    import contextvars
    request = contextvars.ContextVar("request", default=None)
    request.set("user-a")
    seen = []

    def job(emit):
        seen.append(request.get())
        for step in (1, 2):
            emit({"kind": "step", "step": step, "total_steps": 2, "loss": 1.0 / step, "examples_per_s": 8.0,
                  "eta_s": 2 - step})
        emit({"kind": "finished", "summary": {}})

    curves = viz.TrainingCurves()
    events = [e for batch in curves.watch(job, every=0) for e in batch]
    assert seen == ["user-a"] and [e["kind"] for e in events] == ["step", "step", "finished"]
    assert curves.steps == [1, 2] and curves.figures()[0] is not None

    def broken(emit):
        raise ValueError("no such column 'label'")
    events = [e for batch in viz.TrainingCurves().watch(broken, on_error=lambda e: f"bad: {e}") for e in batch]
    assert events == [{"kind": "error", "text": "bad: no such column 'label'"}]


def test_a_free_text_capsule_card_gives_its_losses():
    import capt
    bb = capt.load_backbone("tiny-llama")
    capsule = capt.Capsule.for_backbone(bb)
    capsule.meta["training"] = {"n_train": 9, "steps": 2, "best_dev_loss": 2.5, "best_step": 2, "bare_dev_loss": 3.25}
    text = viz.capsule_markdown(capsule, bb)
    assert ("Trained on free text (9 prompt → completion rows): 2 steps, best dev loss 2.5000 at step 2 (the backbone "
            "alone: 3.2500); no task") in text
    capsule.meta["training"].update(test_loss=2.75, bare_test_loss=3.5, n_test=4)
    assert "(the backbone alone: 3.2500); test loss 2.7500 on 4 rows (the backbone alone: 3.5000); no task" in \
        viz.capsule_markdown(capsule, bb)


def test_training_curves_show_a_dev_loss_as_a_loss():
    """Free-text training (capt.lm_training) selects on the dev loss: the progress line and the dev figure show
    the loss itself (lower is better), not a percentage."""
    curves = viz.TrainingCurves()
    curves.add({"kind": "eval", "step": 2, "dev": {"loss": 2.5}, "best": 2.5, "improved": True})
    curves.add({"kind": "eval", "step": 4, "dev": {"loss": 1.23456}, "best": 1.23456, "improved": True})
    curves.add({"kind": "step", "step": 5, "total_steps": 10, "loss": 1.5, "examples_per_s": 2.0, "eta_s": 10,
                "best": 1.23456})
    assert curves.metric == "loss" and curves.text.endswith("· best dev loss 1.2346")
    fig = curves.figures()[1]
    assert list(fig.data[0].y) == [2.5, 1.23456] and list(fig.data[1].y) == [1.23456]   # and the star on the kept
    assert fig.layout.yaxis.title.text == "loss" and fig.layout.yaxis.range is None
