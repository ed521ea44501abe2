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
                        "accuracy 57.1 % · macro_f1 40.0 % |")
    assert "| linear-head |" in lines[5]
    assert viz.runs_table([]) == ""
