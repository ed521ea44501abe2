"""Speed benchmark: what one training step and one prediction cost with CaPT, against the floor and PEFT.

    python -m train.bench --backbone smollm2-135m [--batch-size 8 --seq-len 128 --repeats 5 --warmup 1]
    python -m train.bench --backbone smollm2-135m --task rte      # the task's own training batches
    python -m train.bench --pool runs/b1.json runs/b2.json         # several --json runs' rounds as one
    python -m train.bench --backbone Qwen/Qwen2.5-1.5B --device cuda --dtype bfloat16   # on a GPU (timed
                                                                   # with the device synchronized)
    python -m train.bench --backbone Qwen/Qwen2.5-7B --random-weights   # an architecture from its config and
                                                                   # tokenizer alone, seeded random weights
    python -m train.bench --backbone smollm2-135m --device cuda --cuda-graphs   # each step captured once as a
                                                                   # CUDA graph and replayed (see below)

Training step = forward + backward + AdamW step (where there are parameters), on the same batches for
every method, with one loss for all: log-softmax of the LM head at each row's last real token, two label
words picked, cross-entropy (as CaPT). The batches are either seeded random token ids (batch_size rows of
exactly seq_len real tokens, no padding: the default) or, with --task, the first batches training builds
from that task's train split (length-bucketed, padded to each batch's longest row, as `python -m train`
feeds them; --seq-len is then unused).
    floor              frozen backbone, backward to inputs_embeds only: no method can train for less
    capt               the default capsule (Capsule.for_backbone), through capt.capsule.run
    prompt-tuning-m    PEFT PromptTuning with m = 20, 100 virtual tokens (capt.peft_baselines)
    p-tuning-v2-m      PEFT PrefixTuning with m = 20, 100 (a K/V prefix at every layer)
  and, to split CaPT's overhead (not compared with the targets):
    floor-plus-1       the floor on the same batches with one more token per row: what the capsule
                       slot's extra position alone costs (the sequence grows from T to T+1)
    floor-minus-1      the floor with each row's first token dropped (T-1 tokens): with floor-plus-1,
                       whether T itself is a fast shape for the kernels (then both neighbours cost more)
    capt-layer0        capt with a capsule at layer 0 only: the slot, build_inputs, one hook and the
                       optimizer, without the other layers' work (with floor-plus-1 and capt, it splits
                       CaPT's extra time into the extra token, the fixed cost and the per-layer work)
    capt / floor-plus-1  capt's paired ratio to floor-plus-1: the capsule's work without the extra token
    capt / capt-layer0   the per-layer mean and slot write of layers 1..L-1 alone
Prediction = forward only, no grad, batch 1 (each batch's first row, unpadded), with and without the capsule.

--cuda-graphs (a CUDA GPU, the default random rows): each row's whole step (forward, backward, optimizer)
is captured once as a CUDA graph and each round replays it on that round's batch, copied into the graph's
input buffers. Eager, a small model's step on a GPU is bound by how fast the host launches kernels, and
CaPT's per-layer mean and slot write add ten small ops per layer (four forward, six backward); a replay
launches the whole step at once, so the ratios then measure the GPU's work. PEFT's rows are left out
there: its prompt-learning forward makes its prefix attention mask on the CPU and copies it to the GPU on
every call, and a copy from unpinned CPU memory cannot be captured.

Why round-robin: a shared CPU drifts (another job starts, the clock throttles, caches warm). Timing
method A for five steps and then method B would put that drift into the A/B ratio; instead round r
runs every method once (order rotated each round) on batch r, so noise hits every method alike.
"x floor" is the median over rounds of (method's time / floor's time in the same round): the paired
ratio, which cancels drift between rounds and ignores a round that a burst of other work spoiled;
"x floor (medians)" is the plain ratio of the two medians, printed beside it. The targets are checked
on the paired ratio. "95 % interval" bootstraps the rounds (resampled with replacement, seeded) to show how
far this machine's noise leaves the paired ratio open; a target inside it is not decided by the run.
Every time is kept in --json, so either can be recomputed.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from capt.backbones import check_device, load_backbone
from capt.capsule import Capsule, build_inputs, run
from capt.config import CapsuleConfig
from capt.errors import CaptError
from capt.scoring import _last_real, encode_prompts, lm_logits, pad
from capt.tasks import custom_task, get_task
from capt.training import CODE, describe_machine

PEFT_ROWS = [("prompt-tuning", 20), ("prompt-tuning", 100), ("p-tuning-v2", 20), ("p-tuning-v2", 100)]
TARGETS = {"step": 1.03, "predict": 1.05}  # CaPT step <= 1.03x floor; prediction <= 1.05x without capsule


def measure(fn, repeats: int, warmup: int, sync=lambda: None) -> list[float]:
    """Wall seconds (time.perf_counter) of each of `repeats` calls of fn(), after `warmup` untimed calls.
    `sync` waits for the device's queued work (torch.cuda.synchronize on a GPU, whose kernels run
    asynchronously): called before the clock starts and before it stops, so a call's time is its own."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def synchronizer(device: torch.device):
    """What waits for `device`'s queued kernels: a no-op on the CPU, where every op finishes before it returns."""
    accel = getattr(torch, device.type, None) if device.type != "cpu" else None
    return getattr(accel, "synchronize", None) or (lambda: None)


def round_robin(fns: dict, batches: list, warmup: int, sync=lambda: None) -> dict[str, list[float]]:
    """Round r runs every fn once on batches[r], order rotated per round; the first `warmup` rounds
    are untimed. Returns each fn's times over the timed rounds."""
    names, times = list(fns), {name: [] for name in fns}
    for r, batch in enumerate(batches):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            timed = r >= warmup
            times[name] += measure(lambda: fns[name](batch), repeats=int(timed), warmup=int(not timed), sync=sync)
    return times


# --- the steps ---------------------------------------------------------------------------------

def label_loss(logp: torch.Tensor, label_ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, V) log-probs at the last position -> CE over the two label words (CaPT's verbalizer loss).
    label_ids: a tensor on logp's device (a Python list would be copied to the GPU on every call)."""
    return F.cross_entropy(logp[:, label_ids], y)


def at_last_real(bb, hidden, index, mask, label_ids, y):
    """hidden (B, T', d): the LM head at each row's last real token (index maps original positions to
    hidden's), then the label loss."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    h = hidden[rows, index[rows, _last_real(mask)]]
    return label_loss(torch.log_softmax(lm_logits(bb, h).float(), -1), label_ids, y)


def floor_loss(bb, ids, mask, label_ids, y):
    """The frozen backbone with no method: run()'s path without hooks, inputs_embeds requiring grad."""
    inp = build_inputs(bb, None, ids, mask)
    embeds = inp.embeds.requires_grad_()  # frozen embedding -> a leaf; backward stops here
    with bb.lock:
        out = bb.model.model(inputs_embeds=embeds, attention_mask=inp.attention_mask,
                             position_ids=inp.position_ids, use_cache=False)
    return at_last_real(bb, out.last_hidden_state, inp.real_index, mask, label_ids, y)


def capt_loss(bb, capsule, ids, mask, label_ids, y):
    """What capt.scoring.score computes for single-token labels, on token ids."""
    out, inp = run(bb, capsule, ids, mask)
    return at_last_real(bb, out.last_hidden_state, inp.real_index, mask, label_ids, y)


def peft_loss(method, ids, mask, label_ids, y):
    """PeftMethod's own forward (virtual tokens offset, LM head only at the last real token)."""
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[torch.arange(mask.shape[0]), _last_real(mask)] = True
    return label_loss(method._log_probs(ids, mask, keep), label_ids, y)


def plus_one(batch):
    """The same rows with their first token repeated in front: T+1 real tokens."""
    ids, mask, y = batch
    return torch.cat([ids[:, :1], ids], 1), torch.cat([mask[:, :1], mask], 1), y


def minus_one(batch):
    """The same rows without their first token: T-1 tokens."""
    ids, mask, y = batch
    return ids[:, 1:], mask[:, 1:], y


def train_step(loss_fn, params: list, capturable: bool = False):
    """forward + backward (+ AdamW step when there are parameters) as one callable on a batch.
    capturable: AdamW keeps its step count on the GPU, so the step can be captured in a CUDA graph."""
    opt = torch.optim.AdamW(params, lr=1e-3, capturable=capturable) if params else None

    def step(batch):
        ids, mask, y = batch
        loss = loss_fn(ids, mask, y)
        if opt:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        if opt:
            opt.step()
    step.optimizer = opt
    return step


def predict_step(bb, capsule):
    """Forward only, no grad: the backbone with or without the capsule, LM head at the end (on `first_row`)."""
    @torch.no_grad()
    def step(batch):
        ids, mask, _ = batch
        out, _ = run(bb, capsule, ids, mask)
        lm_logits(bb, out.last_hidden_state[:, -1])
    return step


def first_row(batch):
    """What a prediction gets: the batch's first row, unpadded (batch 1)."""
    ids, mask, y = batch
    ids = ids[:1, mask[0].bool()]
    return ids, torch.ones_like(ids), y[:1]


def graphed(fn, batch, device: torch.device):
    """fn captured once as a CUDA graph on a copy of `batch`; returns step(batch), which copies a batch of
    the same shapes into the graph's input buffers and replays it."""
    static = tuple(t.clone() for t in batch)
    replay = capture(lambda: fn(static), device)

    def step(b):
        for buffer, t in zip(static, b):
            buffer.copy_(t)
        replay()
    return step


def capture(body, device: torch.device, warmup: int = 3):
    """body() recorded as a CUDA graph on `device`; returns its replay. PyTorch's whole-network recipe:
    warm-up calls on a side stream first (lazy initialisations, the optimizer's state), then the capture
    on that same stream, so per-stream workspaces made in the warm-up serve the capture."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            body()
    return graph.replay


# --- the benchmark -----------------------------------------------------------------------------

def make_batches(bb, n: int, batch_size: int, seq_len: int, seed: int):
    """n seeded batches of random non-special token ids, all real (mask of ones), random 0/1 labels."""
    tok = bb.tokenizer
    vocab = min(len(tok), bb.model.config.vocab_size)
    low = max(tok.all_special_ids) + 1 if max(tok.all_special_ids) < vocab // 2 else 0
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(low, vocab, (batch_size, seq_len), generator=g)
        y = torch.randint(0, 2, (batch_size,), generator=g)
        out.append((ids.to(bb.device), torch.ones_like(ids).to(bb.device), y.to(bb.device)))
    return out


def task_batches(bb, task: str, n: int, batch_size: int, seed: int):
    """The first n batches `python -m train --task <task> --seed <seed>` trains on (epoch 0's length buckets
    of the 90 % train part), tokenized as capt.scoring does (room kept for 100 virtual tokens, so every
    method gets the same ids) and padded on the tokenizer's side; y = label index mod 2."""
    from capt.training import TrainConfig, bucketed_batches, prepare_data

    data = prepare_data(TrainConfig(task=task, backbone=bb.name, seed=seed))
    rendered = [data.task.render(e, bb.style) for e in data.train]
    order = bucketed_batches([len(r.prompt) for r in rendered], batch_size, seed, 0)
    order = [b for b in order if len(b) == batch_size][:n]
    if len(order) < n:
        raise CaptError(f"task '{task}' has {len(order)} full batches of {batch_size}; the benchmark needs {n}")
    out = []
    for b in order:
        prompts, _ = encode_prompts(bb, None, [rendered[i].prompt for i in b], reserve=100)
        ids, mask = pad(prompts, bb.tokenizer.pad_token_id, bb.tokenizer.padding_side)
        y = torch.tensor([rendered[i].label % 2 for i in b])
        out.append((ids.to(bb.device), mask.to(bb.device), y.to(bb.device)))
    return out


def bench(backbone: str, batch_size: int = 8, seq_len: int = 128, repeats: int = 5, warmup: int = 1,
          seed: int = 0, bb=None, task: str | None = None, dtype: str = "float32", device: str | None = None,
          profile: bool = False, random_weights: bool = False, cuda_graphs: bool = False) -> dict:
    """Run every method round-robin; returns the numbers `format_table` prints (and --json writes)."""
    from capt.peft_baselines import PeftMethod

    torch.manual_seed(seed)
    if task:
        get_task(task)  # an unknown task fails here, before the backbone loads
    if cuda_graphs:
        check_graphable(bb.device if bb else device, task, profile)
    bb = bb or load_backbone(backbone, dtype=dtype, device=device, random_weights=random_weights)
    if bb.encoder_decoder:
        raise CaptError("the benchmark covers decoder-only backbones; give e.g. smollm2-135m or tiny-llama")
    if min(batch_size, seq_len, repeats) < 1 or warmup < 0:
        raise CaptError("batch-size, seq-len and repeats must be at least 1, warmup at least 0")
    words = custom_task("bench", ["text"], {"yes": " yes", "no": " no"})
    label_ids = torch.tensor([bb.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" yes", " no")],
                             device=bb.device)
    capsule = Capsule.for_backbone(bb, seed=seed)
    layer0 = Capsule.for_backbone(bb, CapsuleConfig(layers=[0]), seed=seed)
    floor = lambda i, m, y: floor_loss(bb, i, m, label_ids, y)  # noqa: E731
    # name -> (step on a batch, what the batch goes through first, trainable parameters)
    floor_step = train_step(floor, [])   # no parameters, so one step serves the floor and its diagnostics
    steps = {"floor": (floor_step, None, 0),
             "capt": (train_step(lambda i, m, y: capt_loss(bb, capsule, i, m, label_ids, y),
                                 list(capsule.parameters()), cuda_graphs), None, capsule.n_capsule_params())}
    diagnostic = {"floor-plus-1": (floor_step, plus_one), "floor-minus-1": (floor_step, minus_one),
                  "capt-layer0": (train_step(lambda i, m, y: capt_loss(bb, layer0, i, m, label_ids, y),
                                             list(layer0.parameters()), cuda_graphs), None)}
    left_out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for kind, m in PEFT_ROWS:
            if cuda_graphs:
                left_out[f"{kind}-{m}"] = ("PEFT copies a CPU tensor to the GPU in every forward, which a CUDA graph "
                                           "cannot capture")
                continue
            method = PeftMethod(bb, words, kind, num_virtual_tokens=m, seed=seed)
            params = [p for p in method.parameters() if p.requires_grad]
            steps[f"{kind}-{m}"] = (train_step(lambda i, mk, y, me=method: peft_loss(me, i, mk, label_ids, y),
                                               params), None, method.n_trainable())
        every = {name: (fn, prep) for name, (fn, prep, _) in steps.items()}
        every.update(diagnostic)
        every.update({"predict": (predict_step(bb, None), first_row),
                       "predict+capsule": (predict_step(bb, capsule), first_row)})
        batches = (task_batches(bb, task, warmup + repeats, batch_size, seed) if task
                   else make_batches(bb, warmup + repeats, batch_size, seq_len, seed))
        fns = {name: staged(fn, prep, batches if cuda_graphs else None, bb.device)
               for name, (fn, prep) in every.items()}
        times = round_robin(fns, batches, warmup, synchronizer(bb.device))
        ops = profile_ops(fns, batches[warmup:], bb.device) if profile else None
    meta = {"backbone": bb.name, "batch_size": batch_size, "seq_len": seq_len, "repeats": repeats, "task": task,
            "batch_lengths": sorted(m.shape[1] for _, m, _ in batches[warmup:]),  # each timed batch's T
            "warmup": warmup, "threads": torch.get_num_threads(), "device": describe_device(bb.device),
            "dtype": str(bb.dtype).removeprefix("torch."), "machine": describe_machine(bb.device),
            "code": CODE}   # versions, threads, git commit; --pool does not require it to match
    if bb.revision == "random-weights":  # only then, so runs written before the flag still pool with new ones
        meta["random_weights"] = True
    if cuda_graphs:                      # likewise
        meta.update(cuda_graphs=True, left_out=left_out)
    res = summarize(times, {name: n for name, (_, _, n) in steps.items()}, list(diagnostic), meta)
    return {**res, "profile": ops} if ops else res


def staged(fn, prep, graph_batches, device):
    """step(batch) = fn(prep(batch)), run eagerly; or, given graph_batches (the run's batches), fn captured as
    a CUDA graph on the first one and replayed on each. prep then runs once per batch before any timing, as
    it may read values (first_row does) and its ops would otherwise be timed beside a replay's few."""
    prep = prep or (lambda b: b)
    if graph_batches is None:
        return lambda b: fn(prep(b))
    prepared = {id(b): prep(b) for b in graph_batches}
    replay = graphed(fn, prepared[id(graph_batches[0])], device)
    return lambda b: replay(prepared[id(b)])


def check_graphable(device, task, profile) -> None:
    """--cuda-graphs needs batches of one shape and a CUDA device: a clear error before anything loads."""
    if task:
        raise CaptError("--cuda-graphs replays one captured step per method, so every batch needs the same shape: "
                        "use the default random rows (--batch-size, --seq-len), not --task")
    if profile:
        raise CaptError("--profile times each op as it runs; a replayed CUDA graph has no ops to time: "
                        "give one of --profile and --cuda-graphs")
    dev = check_device(device)
    if dev.type != "cuda":
        raise CaptError(f"--cuda-graphs captures CUDA graphs and needs a CUDA GPU; the device here is {dev}")


PROFILED = ("floor", "floor-plus-1", "capt-layer0", "capt")


def profile_ops(fns: dict, batches: list, device: torch.device, names=PROFILED) -> dict[str, dict[str, float]]:
    """Milliseconds per step of each op's own time (torch.profiler; on a GPU its kernels' device time), for
    each of `names` on every batch, order rotated per batch. These steps come after the timed rounds and are
    not timed: the profiler's own cost would distort the ratios."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    total = {name: {} for name in names}

    def profiled(name):
        def step(batch):
            with profile(activities=activities) as prof:
                fns[name](batch)
                synchronizer(device)()
            for e in prof.key_averages():
                us = e.self_device_time_total if gpu else e.self_cpu_time_total
                if us:
                    total[name][e.key] = total[name].get(e.key, 0.0) + us / 1e3 / len(batches)
        return step

    round_robin({name: profiled(name) for name in names}, batches, warmup=0)
    return total


def format_profile(ops: dict[str, dict[str, float]], top: int = 15) -> str:
    """The ops whose time per step differs most between capt and the floor, and every profiled row's total."""
    names = list(ops)
    keys = set().union(*map(set, ops.values()))
    diff = {key: ops["capt"].get(key, 0.0) - ops["floor"].get(key, 0.0) for key in keys}
    lines = ["| op: own time per step, ms (torch.profiler) | " + " | ".join(names) + " | capt - floor |",
             "|---" + "|---:" * (len(names) + 1) + "|"]
    for key in sorted(keys, key=lambda k: -abs(diff[k]))[:top]:
        lines.append(f"| {key} | " + " | ".join(f"{ops[n].get(key, 0.0):.2f}" for n in names) + f" | {diff[key]:+.2f} |")
    totals = {n: sum(ops[n].values()) for n in names}
    lines.append("| **all ops** | " + " | ".join(f"{totals[n]:.1f}" for n in names)
                 + f" | {totals['capt'] - totals['floor']:+.1f} |")
    return "\n".join(lines)


SUMMARY_READS = ("floor", "capt", "floor-plus-1", "capt-layer0", "predict", "predict+capsule")  # rows summarize needs


def summarize(times: dict[str, list[float]], trainable: dict[str, int], diagnostic: list[str], meta: dict) -> dict:
    """Every printed number from the per-round times (what --json keeps, so a run can be re-read)."""
    med = {name: statistics.median(t) for name, t in times.items()}

    def against(name, base="floor"):
        return {"median_s": med[name], "ratio": paired_ratio(times[name], times[base]),
                "ratio_interval": ratio_interval(times[name], times[base]), "ratio_of_medians": med[name] / med[base]}
    rows = [{"name": name, "trainable": n, **against(name)} for name, n in trainable.items()]
    parts = [{"name": name, **against(name)} for name in diagnostic]
    hooks = against("capt", "floor-plus-1")   # the same T+1 tokens on both sides: the capsule's work alone
    pred = against("predict+capsule", "predict")
    return {**meta, "rows": rows, "diagnostic": parts, "capt_vs_floor_plus_1": hooks["ratio"],
            "capt_vs_capt_layer0": paired_ratio(times["capt"], times["capt-layer0"]), "times": times,
            "predict": {"without_s": med["predict"], "with_s": med["predict+capsule"], "ratio": pred["ratio"],
                        "ratio_interval": pred["ratio_interval"], "ratio_of_medians": pred["ratio_of_medians"]},
            "targets": {"capt_step": rows[1]["ratio"] <= TARGETS["step"], "predict": pred["ratio"] <= TARGETS["predict"]}}


def pool(paths: list[Path]) -> dict:
    """Several --json runs of the same set-up as one: their rounds side by side (each round stays paired
    with its own floor), so the paired ratios rest on every round of every run."""
    runs = []
    for path in paths:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise CaptError(f"cannot read benchmark results {path}: {e}") from e
    same = ("backbone", "batch_size", "seq_len", "task", "threads", "device", "dtype", "machine", "random_weights",
            "cuda_graphs")
    for path, r in zip(paths[1:], runs[1:]):
        if "times" not in r or [r.get(k) for k in same] != [runs[0].get(k) for k in same] \
                or list(r["times"]) != list(runs[0]["times"]):
            raise CaptError(f"{path} is not a run of the same benchmark as {paths[0]} (pool only runs with the "
                            f"same {', '.join(same)} and rows, made by the same version of train.bench)")
    first = runs[0]
    missing = [name for name in SUMMARY_READS if name not in first.get("times", {})]
    if missing:
        raise CaptError(f"{paths[0]} has no {', '.join(missing)} timings: an older train.bench wrote it; "
                        f"rerun the benchmark with this version to pool it")
    times = {name: [t for r in runs for t in r["times"][name]] for name in first["times"]}
    meta = {k: first.get(k) for k in (*same, "warmup", "left_out")}
    meta.update(repeats=sum(r["repeats"] for r in runs), pooled=[str(p) for p in paths],
                batch_lengths=sorted(n for r in runs for n in r.get("batch_lengths", [])))
    return summarize(times, {r["name"]: r["trainable"] for r in first["rows"]},
                     [r["name"] for r in first["diagnostic"]], meta)


def paired_ratio(times: list[float], base: list[float]) -> float:
    """Median over rounds of times[r] / base[r] (both timed in round r, on the same batch)."""
    return statistics.median(t / b for t, b in zip(times, base))


def ratio_interval(times: list[float], base: list[float], level: float = 0.95, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of paired_ratio: the rounds resampled with replacement (seeded, so a rerun of --pool
    prints the same), the median of each resample's per-round ratios, and the central `level` of those."""
    ratios = [t / b for t, b in zip(times, base)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return meds[int((1 - level) / 2 * resamples)], meds[int((1 + level) / 2 * resamples) - 1]


def describe_device(device: torch.device) -> str:
    """'cpu', or e.g. 'cuda:0 (NVIDIA H200)'."""
    if device.type == "cuda":
        return f"{device.type}:{device.index or 0} ({torch.cuda.get_device_name(device)})"
    return str(device)


def format_table(res: dict) -> str:
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    p, capt_row = res["predict"], res["rows"][1]
    if res.get("task"):
        n = res["batch_lengths"]
        shape = (f"{res['task']} training batches of {res['batch_size']}, padded to {n[0]}-{n[-1]} tokens "
                 f"(median {statistics.median(n):g})")
    else:
        shape = f"batch {res['batch_size']} x {res['seq_len']} tokens"
    rounds = (f"{res['repeats']} round-robin rounds pooled from {len(res['pooled'])} runs" if res.get("pooled")
              else f"median of {res['repeats']} round-robin repeats ({res['warmup']} warmup)")
    where = f"{res['threads']} threads" if res.get("device") in (None, "cpu") else res["device"]  # None: older JSON
    if res.get("machine") and res.get("device") in (None, "cpu"):   # older JSON has no machine
        where += f" on {res['machine']['cpu']} ({res['machine']['isa']})"
    where += f", {res['dtype']}" if res.get("dtype") not in (None, "float32") else ""
    where += ", every step a replayed CUDA graph" if res.get("cuda_graphs") else ""
    name = res["backbone"] + (" (seeded random weights)" if res.get("random_weights") else "")
    lines = [f"Backbone {name}: {shape}, {rounds}, {where}",
             "", "| name | trainable params | median step s | x floor | 95 % interval | x floor (medians) |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['trainable']:,} | {r['median_s']:.4f} | {r['ratio']:.3f} | {_span(r)} | "
              f"{r['ratio_of_medians']:.3f} |" for r in res["rows"]]
    lines += [f"| {name} | left out: {why} | | | | |" for name, why in (res.get("left_out") or {}).items()]
    lines += ["", "| where CaPT's extra time goes (diagnostic) | median step s | x floor | 95 % interval | "
              "x floor (medians) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['median_s']:.4f} | {r['ratio']:.3f} | {_span(r)} | {r['ratio_of_medians']:.3f} |"
              for r in res["diagnostic"]]
    lines += ["", f"capt / floor-plus-1 (the capsule's work alone, same T+1 tokens): {res['capt_vs_floor_plus_1']:.3f}x",
              f"capt / capt-layer0 (the per-layer work of layers 1..L-1): {res['capt_vs_capt_layer0']:.3f}x"]
    lines += ["", "| prediction (batch 1) | median s |", "|---|---:|",
              f"| without capsule | {p['without_s']:.4f} |", f"| with capsule | {p['with_s']:.4f} |",
              f"| ratio | {p['ratio']:.3f} |", f"| ratio 95 % interval | {_span(p)} |",
              f"| ratio (medians) | {p['ratio_of_medians']:.3f} |", "",
              f"- CaPT step <= {TARGETS['step']}x floor: {ok(res['targets']['capt_step'])} ({capt_row['ratio']:.3f}x"
              f"{_decides(capt_row, TARGETS['step'])})",
              f"- prediction with capsule <= {TARGETS['predict']}x without: {ok(res['targets']['predict'])} "
              f"({p['ratio']:.3f}x{_decides(p, TARGETS['predict'])})"]
    return "\n".join(lines)


def _span(r: dict) -> str:
    lo, hi = r["ratio_interval"]
    return f"{lo:.3f}-{hi:.3f}"


def _decides(r: dict, target: float) -> str:
    """The interval beside a target's verdict, and whether the run's noise leaves that verdict open."""
    lo, hi = r["ratio_interval"]
    return f"; 95 % interval {_span(r)}" + (": the target lies inside it, so this run does not decide it"
                                            if lo <= target <= hi else "")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", help="time on this task's own training batches (e.g. rte) instead of random ids")
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    ap.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when there is one, else cpu)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile floor, floor-plus-1, capt-layer0 and capt on the same batches (after the "
                         "timing, untimed) and print the ops that make their difference")
    ap.add_argument("--random-weights", action="store_true",
                    help="the backbone's architecture with seeded random weights (a hub id or folder then needs "
                         "only its config and tokenizer): times an architecture without its weights")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture each row's step once as a CUDA graph and replay it (a CUDA GPU; see above)")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: print the table for these --json runs' rounds taken together")
    a = ap.parse_args(argv)
    try:
        res = pool(a.pool) if a.pool else bench(a.backbone, a.batch_size, a.seq_len, a.repeats, a.warmup, a.seed,
                                                task=a.task, dtype=a.dtype, device=a.device, profile=a.profile,
                                                random_weights=a.random_weights, cuda_graphs=a.cuda_graphs)
    except CaptError as e:
        sys.exit(f"error: {e}")
    print(format_table(res))
    if res.get("profile"):
        print("\n" + format_profile(res["profile"]))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
