"""What the app shows: plotly figures (label probabilities, attention maps, anchor mass, training curves)
and the short Markdown summaries that go with them; the text a user sees of an error; and TrainingCurves,
which follows a training run in a background thread and turns its events into live figures.

Plotly is imported inside each function, so `import capt` stays light and plotting is optional. Every
function takes plain data (dicts, numpy arrays, an AttentionReport, Predictions, a training summary or
events) and returns a `plotly.graph_objects.Figure` or text; nothing here knows about Gradio.
"""
from __future__ import annotations

import contextvars
import math
import queue
import sys
import threading
import time
import traceback

import numpy as np

WITH_COLOR, WITHOUT_COLOR, SOFT_COLOR = "#d9480f", "#748ffc", "#2b8a3e"
_MAX_TICKS = 60  # longer inputs label every k-th token so the axes stay readable


def _go():
    import plotly.graph_objects as go
    return go


def _layout(fig, title: str, height: int = 360, legend_below: bool = False):
    top, bottom = 50, 90 if legend_below else 50
    fig.update_layout(title={"text": title, "font": {"size": 14}}, height=height, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": top, "b": bottom})
    if legend_below:
        # a fixed 48 px under the plot area, below the x-axis title at any figure height
        fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -48 / (height - top - bottom)})
    return fig


def probs_figure(labels: list[str], with_capsule: dict[str, float] | None, without: dict[str, float] | None,
                 capsule_name: str = "capsule", title: str = "Label probabilities") -> "object":
    """Grouped bars: each label's probability with the capsule and without it (the bare backbone)."""
    go = _go()
    fig = go.Figure()
    for name, probs, color in ((f"with {capsule_name}", with_capsule, WITH_COLOR),
                               ("without capsule (zero-shot)", without, WITHOUT_COLOR)):
        if probs is None:
            continue
        values = [probs.get(lab, 0.0) for lab in labels]
        fig.add_bar(name=name, x=list(labels), y=values, marker_color=color,
                    text=[f"{100 * v:.1f}%" for v in values], textposition="outside")
    fig.update_layout(barmode="group", yaxis={"range": [0, 1.12], "title": "probability", "tickformat": ".0%"},
                      legend={"orientation": "h", "y": -0.15})
    return _layout(fig, title)


def _tick_labels(tokens: list[str]) -> tuple[list[int], list[str]]:
    step = max(1, math.ceil(len(tokens) / _MAX_TICKS))
    shown = list(range(0, len(tokens), step))
    return shown, [f"{i}:{_clean(tokens[i])}" for i in shown]


def _clean(token: str) -> str:
    token = token.replace("\n", "⏎").replace("\t", "⇥")
    token = token if token.strip() else token.replace(" ", "␣")
    return token[:18]


def attention_figure(report, layer: int | None = None, head: int | None = None, title: str = "",
                     zmax: float | None = None) -> "object":
    """(T, T) attention heatmap (row = query, column = key), mean over layers/heads where None,
    with the anchor's column and row outlined (the capsule slot, or position 0 / BOS without one)."""
    go = _go()
    z = report.mean_map(layer, head)
    tokens = list(report.tokens)
    if len(tokens) <= 120:  # token names on hover; longer inputs would make the figure megabytes big
        hover = dict(hoverinfo="text", text=[[f"query {q}: {_clean(tokens[q])}<br>key {k}: {_clean(tokens[k])}"
                                              f"<br>attention {z[q, k]:.4f}" for k in range(len(tokens))]
                                             for q in range(len(tokens))])
    else:
        hover = dict(hovertemplate="query %{y}, key %{x}<br>attention %{z:.4f}<extra></extra>")
    fig = go.Figure(go.Heatmap(z=z, zmin=0.0, zmax=zmax if zmax is not None else float(z.max()),
                               colorscale="Viridis", colorbar={"title": "attn"}, **hover))
    a, n, span = report.anchor, len(tokens), _span(report)
    outline = {"color": "#ff6b6b", "width": 2}
    fig.add_shape(type="rect", x0=a - 0.5, x1=a + span - 0.5, y0=-0.5, y1=n - 0.5, line=outline)
    fig.add_shape(type="rect", x0=-0.5, x1=n - 0.5, y0=a - 0.5, y1=a + span - 0.5, line={**outline, "dash": "dot"})
    fig.add_annotation(x=a, y=-0.5, text=f"{report.anchor_label}", showarrow=True, arrowhead=2, ax=30, ay=-28,
                       font={"color": "#c92a2a"})
    ticks, text = _tick_labels(tokens)
    fig.update_xaxes(tickvals=ticks, ticktext=text, tickangle=-60, tickfont={"size": 9}, title="key (attended to)")
    fig.update_yaxes(tickvals=ticks, ticktext=text, tickfont={"size": 9}, autorange="reversed",
                     title="query (attending)")
    where = ("mean over layers and heads" if layer is None and head is None else
             f"layer {layer if layer is not None else 'mean'}, head {head if head is not None else 'mean'}")
    return _layout(fig, f"{title} — {where}" if title else where, height=max(420, min(900, 14 * n + 160)))


def _span(report) -> int:   # anchor positions: 1, or a soft prompt's m tokens
    return int(getattr(report, "anchor_span", 1) or 1)


def anchor_mass_figure(report, title: str = "", zmax: float | None = None) -> "object":
    """(layers, heads) heatmap of the attention the other tokens pay to the anchor."""
    go = _go()
    mass = report.anchor_mass()
    layers, heads = mass.shape
    fig = go.Figure(go.Heatmap(z=mass, x=list(range(heads)), y=list(range(layers)), zmin=0.0,
                               zmax=zmax if zmax is not None else float(mass.max() or 1.0), colorscale="Magma",
                               colorbar={"title": "mass"},
                               hovertemplate="layer %{y}, head %{x}<br>mass on anchor %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", autorange="reversed", dtick=1 if layers <= 32 else None)
    name = f"attention mass on {report.anchor_label} (mean over the other tokens)"
    return _layout(fig, f"{title} — {name}" if title else name, height=max(320, min(700, 18 * layers + 140)))


def anchor_by_layer_figure(with_report, without_report, capsule_name: str = "capsule", soft_report=None,
                           soft_name: str = "soft prompt") -> "object":
    """Per layer, the mean (over heads and tokens) attention paid to the anchor: capsule vs sink (vs the tokens
    of a trained soft prompt, when given)."""
    go = _go()
    fig = go.Figure()
    for report, name, color in ((with_report, f"with {capsule_name}: {getattr(with_report, 'anchor_label', '')}",
                                 WITH_COLOR),
                                (without_report, f"without: {getattr(without_report, 'anchor_label', '')}",
                                 WITHOUT_COLOR),
                                (soft_report, f"with {soft_name}: its {_span(soft_report)} tokens", SOFT_COLOR)):
        if report is None:
            continue
        per_layer = report.anchor_mass().mean(1)
        fig.add_scatter(x=list(range(len(per_layer))), y=per_layer, mode="lines+markers", name=name,
                        line={"color": color})
    fig.update_xaxes(title="layer", dtick=1 if fig.data and len(fig.data[0].x) <= 32 else None)
    fig.update_yaxes(title="attention on anchor", rangemode="tozero")
    return _layout(fig, "Anchor vs. sink: attention the other tokens pay to the anchor, per layer", legend_below=True)


def loss_figure(steps: list[int], losses: list[float]) -> "object":
    """Training loss per step, raw and smoothed (exponential moving average)."""
    go = _go()
    fig = go.Figure()
    fig.add_scatter(x=list(steps), y=list(losses), mode="lines", name="loss", line={"color": "#adb5bd"})
    if len(losses) > 2:
        smooth, s = [], losses[0]
        for v in losses:
            s = 0.9 * s + 0.1 * v
            smooth.append(s)
        fig.add_scatter(x=list(steps), y=smooth, mode="lines", name="smoothed", line={"color": WITH_COLOR})
    fig.update_xaxes(title="step", rangemode="tozero")
    fig.update_yaxes(title="cross-entropy")
    return _layout(fig, "Training loss", height=320, legend_below=True)


def dev_figure(evals: list[dict], metric: str) -> "object":
    """Dev metrics at each evaluation (percent; metric "loss", free-text training: the loss itself); `evals` are
    training 'eval' events."""
    go = _go()
    fig = go.Figure()
    names = list(evals[0]["dev"]) if evals else [metric]
    scale = 1 if metric == "loss" else 100
    for name in names:
        fig.add_scatter(x=[e["step"] for e in evals], y=[scale * e["dev"][name] for e in evals],
                        mode="lines+markers", name=f"dev {name}")
    best = [e for e in evals if e.get("improved")]
    if best:
        b = best[-1]
        fig.add_scatter(x=[b["step"]], y=[scale * b["dev"][metric]], mode="markers", name="best (kept)",
                        marker={"symbol": "star", "size": 14, "color": WITH_COLOR})
    fig.update_xaxes(title="step", rangemode="tozero")
    if metric == "loss":
        fig.update_yaxes(title="loss")
    else:
        fig.update_yaxes(title="%", range=[0, 100])
    return _layout(fig, f"Dev metrics (selection: {metric})", height=320, legend_below=True)


def shared_max(*arrays: np.ndarray | None) -> float:
    """One colour range for side-by-side maps, so 'with' and 'without' compare at a glance."""
    values = [float(np.max(a)) for a in arrays if a is not None and np.size(a)]
    return max(values) if values else 1.0


def attention_panel(with_report, without_report, layer: int | None = None, head: int | None = None,
                    name: str = "capsule", soft_report=None, soft_name: str = "soft prompt") -> tuple[tuple, str]:
    """The Attention view: (maps with / without / with a soft prompt, anchor mass with / without / soft prompt,
    per-layer anchor vs sink) and a one-paragraph summary; the soft-prompt figures are None without one.
    layer/head None or negative: the mean over all. Colour ranges are shared by all sides (maps clipped at
    the largest value off the anchor's rows and columns, so the sink does not wash out the rest)."""
    from .errors import CaptError

    for what, value, n in (("layer", layer, with_report.maps.shape[0]), ("head", head, with_report.maps.shape[1])):
        if value is not None and value >= n:
            raise CaptError(f"{what} {value} does not exist: there are {what}s 0..{n - 1} (-1 = the mean)")
    layer = None if layer is None or layer < 0 else int(layer)
    head = None if head is None or head < 0 else int(head)
    reports = [r for r in (with_report, without_report, soft_report) if r is not None]

    def off_anchor(report):  # the map without the anchor's rows and columns
        span = range(report.anchor, report.anchor + _span(report))
        keep = [i for i in range(len(report.tokens)) if i not in span]
        return report.mean_map(layer, head)[np.ix_(keep, keep)]

    zmax = max(1e-6, shared_max(*map(off_anchor, reports)))
    mmax = shared_max(*(r.anchor_mass() for r in reports))
    soft = soft_report is not None
    figs = (attention_figure(with_report, layer, head, f"with {name}", zmax=zmax),
            attention_figure(without_report, layer, head, "without capsule", zmax=zmax),
            attention_figure(soft_report, layer, head, f"with {soft_name}", zmax=zmax) if soft else None,
            anchor_mass_figure(with_report, f"with {name}", zmax=mmax),
            anchor_mass_figure(without_report, "without capsule", zmax=mmax),
            anchor_mass_figure(soft_report, f"with {soft_name}", zmax=mmax) if soft else None,
            anchor_by_layer_figure(with_report, without_report, name, soft_report, soft_name))
    n_layers, n_heads = with_report.maps.shape[:2]
    text = (f"{len(with_report.tokens)} positions with the {name}, {len(without_report.tokens)} without · "
            f"{n_layers} layers × {n_heads} heads. Mean attention the other tokens pay to the anchor: "
            f"**{with_report.anchor_mass().mean():.3f}** (the {name}) vs **{without_report.anchor_mass().mean():.3f}**"
            f" ({without_report.anchor_label}, without a capsule)")
    if soft:
        text += (f" vs **{soft_report.anchor_mass().mean():.3f}** (all {_span(soft_report)} tokens of the "
                 f"{soft_name} together)")
    text += ". Colour ranges are shared by all maps."
    if any(r.truncated for r in reports):
        text += "\n\n⚠ the input was cut to the backbone's limit."
    return figs, text


def probe_figure(accuracy: dict[int, float], n_examples: int, title: str = "") -> "object":
    """Bars: accuracy on a val sample for each number k of mean-pooled instance tokens (k = 0: as trained)."""
    go = _go()
    ks = sorted(accuracy)
    values = [accuracy[k] for k in ks]
    fig = go.Figure(go.Bar(x=[str(k) for k in ks], y=values, text=[f"{100 * v:.1f}%" for v in values],
                           textposition="outside",
                           marker_color=[WITHOUT_COLOR if k == 0 else WITH_COLOR for k in ks]))
    fig.update_xaxes(title="pooled instance tokens prepended (0 = the capsule as trained)", type="category")
    fig.update_yaxes(title=f"accuracy on {n_examples} val examples", range=[0, 1.12], tickformat=".0%")
    return _layout(fig, title or "Training-free probe: k mean-pooled instance tokens")


def error_message(e: Exception) -> str:
    """What a user is shown of an error: capt's own message for a CaptError; for anything else its type and
    text, with the traceback printed to stderr (the server's log). Call it inside the `except` block."""
    from .errors import CaptError

    if isinstance(e, CaptError):
        return str(e)
    traceback.print_exc(file=sys.stderr)
    return f"Unexpected error ({type(e).__name__}): {e}"


def _clock(seconds: float | None) -> str:
    s = int(seconds or 0)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def in_thread(job, on_error=str) -> queue.Queue:
    """Start `job(emit)` in a daemon thread, in the caller's context (ZeroGPU's spaces.GPU reads the Gradio
    request, hence whose quota, from a contextvar); return the queue its emitted events arrive in. An exception
    it raises arrives as an "error" event with the text `on_error(exception)`."""
    events = queue.Queue()

    def run():
        try:
            job(events.put)
        except Exception as e:
            events.put({"kind": "error", "text": on_error(e)})

    threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True, name="capt-training").start()
    return events


class TrainingCurves:
    """Collects `capt.training.train` callback events; gives the live loss/dev figures and a progress line.
    `watch` runs a training job in a thread and yields its events in batches paced for a UI."""

    def __init__(self):
        self.steps, self.losses, self.evals = [], [], []
        self.metric, self.text = "accuracy", ""

    def add(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == "step":
            self.steps.append(event["step"])
            self.losses.append(event["loss"])
            best = "" if event.get("best") is None else f" · best dev {self.metric} " + (
                f"{event['best']:.4f}" if self.metric == "loss" else f"{100 * event['best']:.1f} %")
            early = "" if event.get("early_stop_step") is None else (   # capt.training's records; train_lm's lack it
                f" (early stopping at step {event['early_stop_step']}, in {_clock(event['early_stop_eta_s'])}, "
                "unless dev improves)")
            self.text = (f"step {event['step']}/{event['total_steps']} · loss {event['loss']:.4f} · "
                         f"{event['examples_per_s']:.1f} examples/s · ETA {_clock(event['eta_s'])}{early}{best}")
        elif kind == "eval":
            self.evals.append(event)
            self.metric = next((m for m in ("loss", "f1a") if m in event["dev"]), "accuracy")
        elif kind == "info":   # the caller's own progress lines ("loading the backbone…")
            self.text = event["text"]

    def watch(self, job, on_error=str, every: float = 0.5):
        """Run `job(emit)` in a daemon thread (`in_thread`) and yield its events as `follow` does. The job emits
        the `train` callback's events and its own ("info", then "finished" with the summary)."""
        yield from self.follow(in_thread(job, on_error), every)

    def follow(self, events: queue.Queue, every: float = 0.5, poll: float = 0.25):
        """Read events from a queue that a training thread fills (its `train` callback, plus the caller's
        "info", "finished" and "error" events) and add each, until a "finished" or "error" one. Yields the
        list of events read since the last yield: at most every `every` seconds, and the last list at once,
        so a UI redraws at a steady pace however fast the steps come."""
        pending, last, done = [], 0.0, False
        while not done:
            try:
                batch = [events.get(timeout=poll)]
                while not events.empty():
                    batch.append(events.get_nowait())
            except queue.Empty:
                batch = []
            for event in batch:
                self.add(event)
            pending += batch
            done = any(event.get("kind") in ("finished", "error") for event in batch)
            if pending and (done or time.time() - last > every):
                last = time.time()
                yield pending
                pending = []

    def figures(self) -> tuple:
        return (loss_figure(self.steps, self.losses) if self.steps else None,
                dev_figure(self.evals, self.metric) if self.evals else None)


def prediction_panel(task, backbone, bare, mine=None, capsule=None, notes=()) -> tuple[object, str]:
    """The Predict view of one example: the label probabilities with the capsule (`mine`, a Prediction) and
    without it (`bare`), and a Markdown report: both predicted labels, the capsule's parameters and training
    (capsule_markdown), and each note as a ⚠ line (an input cut to the backbone's limit adds one)."""
    fig = probs_figure(list(task.labels), mine.probs if mine else None, bare.probs,
                       title=f"{task.name} on {backbone.name}")
    said = [f"{who}: **{p.label}** ({100 * p.probs[p.label]:.1f} %)"
            for who, p in (("with capsule", mine), ("without capsule", bare)) if p is not None]
    notes = list(notes)
    if bare.truncated:
        notes.append(f"the input was longer than the backbone's limit: {bare.dropped_tokens} tokens were cut")
    report = "No capsule: the bare backbone (zero-shot)." if capsule is None else capsule_markdown(capsule, backbone)
    return fig, " · ".join(said) + "\n\n" + report + "".join(f"\n\n⚠ {n}" for n in notes)


def generation_markdown(prompt: str, bare, mine=None, notes=()) -> str:
    """The continuation view: the prompt, then what the backbone writes after it without the capsule (`bare`, a
    capt.Generation) and with it (`mine`), each as plain text in a code block; each note as a ⚠ line."""
    def block(text: str) -> str:
        text = (text or "(nothing: the backbone ended the text at once)").replace("```", "` ` `")
        return f"```text\n{text}\n```"
    parts = ["**Prompt**", block(prompt), "**Without capsule** (the bare backbone)", block(bare.text)]
    if mine is not None:
        parts += ["**With capsule** (computed once, in the prefill over the prompt)", block(mine.text)]
    notes = list(notes)
    if bare.truncated:
        notes.append(f"the prompt was longer than the backbone's limit: {bare.dropped_tokens} tokens were cut")
    return "\n\n".join(parts) + "".join(f"\n\n⚠ {n}" for n in notes)


def capsule_markdown(capsule, backbone) -> str:
    """The capsule's parameter count and share of the backbone, its options and how it was trained."""
    rep, cfg, tr = capsule.param_report(backbone), capsule.config, capsule.meta.get("training") or {}
    text = (f"| parameters | count |\n|---|---:|\n| capsule (W + fusion extras) | {rep['capsule']:,} |\n"
            f"| task head | {rep['head']:,} |\n| backbone (frozen) | {rep['backbone']:,} |\n"
            f"| capsule / backbone | {rep['share_percent']:.4f} % |\n\nOptions: fusion `{cfg.fusion}` · placement "
            f"`{cfg.placement}` · layers `{cfg.layers}` · head `{cfg.head}`: a capsule on {len(capsule.layer_ids)} "
            f"of {backbone.n_layers} layers, d = {backbone.hidden_size}")
    if tr and "best_dev_loss" in tr:   # capt.lm_training: free text, no task (a test split only if one was given)
        bare = f" (the backbone alone: {tr['bare_dev_loss']:.4f})" if tr.get("bare_dev_loss") else ""
        test = (f"; test loss {tr['test_loss']:.4f} on {tr['n_test']} rows (the backbone alone: "
                f"{tr['bare_test_loss']:.4f})") if "test_loss" in tr else ""
        text += (f"\n\nTrained on free text ({tr.get('n_train')} prompt → completion rows): {tr.get('steps')} steps, "
                 f"best dev loss {tr['best_dev_loss']:.4f} at step {tr.get('best_step')}{bare}{test}; no task, so no "
                 "label scores: try it in the generation view with your own prompt")
    elif tr:
        scores = ", ".join(f"{k} {100 * v:.1f} %" for k, v in (capsule.meta.get("metrics") or {}).items())
        text += (f"\n\nTrained on `{tr.get('task')}`: {tr.get('steps')} steps ({tr.get('stopped_by')}); test "
                 f"{scores or 'n/a'} on {tr.get('n_test')} examples")
    return text


def summary_markdown(summary: dict) -> str:
    """One paragraph on a finished `capt.training.train` run (its returned summary)."""
    scores = " · ".join(f"{k} {100 * v:.1f} %" for k, v in summary["test"].items())
    share = 100 * summary["n_trainable"] / summary["backbone_params"]
    return (f"**Done** ({summary['stopped_by']}): {summary['steps']} steps in {summary['train_seconds']:.0f} s, best "
            f"dev at step {summary['best_step']}. Test ({summary['n_test']} examples): {scores}. "
            f"{summary['n_trainable']:,} trainable parameters ({share:.4f} % of the backbone). "
            f"Data: {summary['data']}.{answers_sentence(summary)}")


def lm_summary_markdown(summary: dict) -> str:
    """One paragraph on a finished free-text run (`capt.lm_training.train_lm`'s summary)."""
    cut = summary.get("n_prompts_cut")
    return (f"**Done** ({summary['stopped_by']}): {summary['steps']} steps in {summary['train_seconds']:.0f} s, best "
            f"dev loss {summary['best_dev_loss']:.4f} at step {summary['best_step']}, the backbone alone "
            f"{summary['bare_dev_loss']:.4f} ({summary['n_train']} train / "
            f"{summary['n_dev']} dev rows{f'; {cut} prompt(s) cut at the start to fit' if cut else ''}). "
            f"{summary['n_trainable']:,} trainable parameters.")


def counts_text(counts: dict) -> str:
    """`capt.training.label_counts` in one line: 'gold (how many) → n answer, n answer; ...'."""
    return "; ".join(f"{g} ({sum(row.values())}) → " + ", ".join(f"{n} {p}" for p, n in row.items())
                     for g, row in counts.items())


def answers_sentence(summary: dict) -> str:
    """' What it answered ...' from a summary's test_counts ('' for runs that predate them): per gold label how
    many of each answer, so a run that learned to answer one label everywhere shows it; for accuracy, what
    always answering the test split's most frequent label would score beside it."""
    counts = summary.get("test_counts")
    if not counts:
        return ""
    text = f" What it answered on the test split, gold label (how many) → answers: {counts_text(counts)}."
    if "accuracy" in summary["test"]:
        text += one_label_sentence(counts)
    return text


def one_label_sentence(counts: dict) -> str:
    """' Always answering 'X' would score Y % accuracy here.' for the most frequent gold label of `counts`
    (`capt.training.label_counts`): the bar a run that learned one answer reaches ('' when counts are empty)."""
    bar = one_label_bar(counts)
    return f" Always answering '{bar[0]}' would score {100 * bar[1]:.1f} % accuracy here." if bar else ""


def one_label_bar(counts: dict) -> tuple[str, float] | None:
    """(label, accuracy) of always answering the most frequent gold label of `counts` (None when empty)."""
    totals = {g: sum(row.values()) for g, row in counts.items()}
    if not sum(totals.values()):
        return None
    top = max(totals, key=totals.get)
    return top, totals[top] / sum(totals.values())


def run_row(summary: dict, when: str = "") -> dict:
    """The few fields of a finished run's summary that `runs_table` shows (small: it lives in a session)."""
    bar = one_label_bar(summary.get("test_counts") or {}) if "accuracy" in summary["test"] else None
    return dict(time=when, task=summary["task"], method=summary["method"], backbone=summary["backbone"],
                n_trainable=summary["n_trainable"], steps=summary["steps"], seconds=summary["train_seconds"],
                n_test=summary["n_test"],
                test=" · ".join(f"{k} {100 * v:.1f} %" for k, v in summary["test"].items()),
                bar=f"'{bar[0]}' {100 * bar[1]:.1f} %" if bar else "")


def lm_run_row(summary: dict, when: str = "") -> dict:
    """`run_row` for a free-text run: no test split, so its column shows the best dev loss."""
    return dict(time=when, task="free text", method="capt", backbone=summary["backbone"],
                n_trainable=summary["n_trainable"], steps=summary["steps"], seconds=summary["train_seconds"],
                n_test=0, test=f"dev loss {summary['best_dev_loss']:.4f}, alone {summary['bare_dev_loss']:.4f} "
                               f"({summary['n_dev']} rows)", bar="")


def runs_table(rows: list[dict]) -> str:
    """Finished runs side by side as a markdown table (rows from `run_row`; "" when there are none)."""
    if not rows:
        return ""
    lines = [f"| {r['time']} | {r['task']} | {r['method']} | {r['backbone']} | {r['n_trainable']:,} | {r['steps']} | "
             f"{r['seconds']:.0f} | {r['n_test']} | {r['test']} | {r.get('bar', '')} |" for r in rows]
    return ("**Runs in this session** (test metrics on each run's test split; the same task and preset give the "
            "same split; *one label* is the accuracy of always answering the split's most frequent label)\n\n"
            "| time | task | method | backbone | trainable | steps | seconds | test examples | test | one label |\n"
            "|---|---|---|---|---:|---:|---:|---:|---|---|\n" + "\n".join(lines))
