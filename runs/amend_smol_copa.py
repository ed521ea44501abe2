"""One-off (session 38): replace the linear-head row of capsules/smollm2-135m/copa with its rerun after dc505ad.
The compare folder of that card is gone, so train.card cannot rewrite it; the rows are rendered with train.card's
own helpers (old ones checked to be the card's text before they are replaced)."""
import json
from pathlib import Path

from train import card
from train.card import _per_seed_table, _primary, _steps, metric_cell, seed_runs

folder, run = Path("capsules/smollm2-135m/copa"), Path("runs/copa-linear-head-fixed")
results = json.loads((folder / "results.json").read_text())
text = (folder / "README.md").read_text()
new_cmp = json.loads((run / "compare.json").read_text())
new_sum = json.loads((run / "linear-head" / "summary.json").read_text())
(new_row,) = new_cmp["rows"]


def line(r, steps):
    keys = card.compare_metric_keys(r)
    return (f"| {r['method']} | {r['trainable']:,} | {r['train_seconds']:.0f} | {_steps(steps)} | "
            + " | ".join(metric_cell(r, k) for k in keys) + " |")


old_rows = results["rows"]
i = next(k for k, r in enumerate(old_rows) if r["method"] == "linear-head")
old_row, old_seeds = old_rows[i], results["seed_runs"]["linear-head"]
old_line = line(old_row, [r["steps"] for r in old_seeds])
assert old_line in text, old_line
new_seeds = seed_runs({"linear-head": new_sum})["linear-head"]
rows = old_rows[:i] + [new_row] + old_rows[i + 1:]
old_table = _per_seed_table(results["seed_runs"], old_rows, _primary(old_rows[0]))
assert old_table in text
per_seed = {**results["seed_runs"], "linear-head": new_seeds}
new_table = _per_seed_table(per_seed, rows, _primary(rows[0]))
text = text.replace(old_line, line(new_row, [r["steps"] for r in new_seeds])).replace(old_table, new_table)
old_note = next(ln for ln in text.splitlines() if ln.startswith("- Found on 2026-12-07"))
pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
note = (
    "- Fixed on 2026-12-07 (commit dc505ad), and the linear head rerun: before the fix, on a decoder-only backbone "
    "the head read the last token of COPA's LM prompt (lm-eval's, e.g. 'The man turned on the faucet therefore'), "
    "which does not contain the two alternatives the other methods score as continuations, so it could only guess "
    f"from the premise: {pct(old_row['test_accuracy'])} ± {pct(old_row['test_accuracy_std'])} "
    f"({', '.join(pct(r['test']['accuracy']) for r in old_seeds)}; steps {_steps([r['steps'] for r in old_seeds])}; "
    f"{old_row['train_seconds']:.0f} s), the number this card had; every linear-head number in the bullets above "
    "predates the fix too. Since the fix it reads the prompt followed by the alternatives ('...therefore⏎Option 1: the toilet "
    "filled with water.⏎Option 2: water flowed from the spout.⏎Answer: Option'), the same text a --head linear "
    "capsule reads. The table's linear-head rows are its rerun at this compare's settings, the linear head alone "
    f"(this card's compare folder is gone): `{card.shown_command(new_cmp['command'])}` (commit dc505ad, 2 cores of an "
    f"AMD EPYC with AVX-512, sharing them with another run, hence its {new_row['train_seconds']:.0f} s): "
    f"{pct(new_row['test_accuracy'])} ± {pct(new_row['test_accuracy_std'])} "
    f"({', '.join(pct(r['test']['accuracy']) for r in new_seeds)}; best dev "
    f"{', '.join(pct(r['dev']['accuracy']) for r in new_seeds)} %), above the majority class, below zero-shot and "
    "CaPT on every seed. The bare model does not have the answer at that token either: scoring ' 1' against ' 2' "
    "after that text, SmolLM2-135M picks the right option on 44 of the 100 test examples (a one-off check with "
    "capt.score). This bullet and the linear-head rows were written by a one-off script with train.card's own row "
    "helpers (train.card needs the compare folder); results.json keeps the replaced row under 'replaced'.")
text = text.replace(old_note, note)
results = {**results, "rows": rows, "seed_runs": per_seed,
           "replaced": [{"method": "linear-head", "date": "2026-12-07", "by": new_cmp["command"], "commit": "dc505ad",
                         "why": "before dc505ad the linear head read COPA's LM prompt without the alternatives",
                         "row": old_row, "seed_runs": old_seeds}]}
(folder / "README.md").write_text(text)
(folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
print("ok")
