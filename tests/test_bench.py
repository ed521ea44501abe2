"""train.bench on the shared tiny-llama: every row is printed, the JSON matches the table, and the
shared backbone comes out exactly as it went in (no hooks, no flags, same weights, same outputs)."""
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import tiny
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import capt
from capt.training import describe_machine

import train.bench as bench

ROWS = ["floor", "capt", "prompt-tuning-20", "prompt-tuning-100", "p-tuning-v2-20", "p-tuning-v2-100"]


def snapshot(bb):
    """Everything a method could leave behind on a shared backbone."""
    hooks = {name: tuple(len(getattr(mod, attr)) for attr in
                         ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                          "_state_dict_hooks", "_load_state_dict_pre_hooks"))
             for name, mod in bb.model.named_modules()}
    ids = torch.arange(4, 20)[None]
    with torch.no_grad():
        logits = bb.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return {"hooks": hooks, "grad": [p.requires_grad for p in bb.model.parameters()],
            "training": [m.training for m in bb.model.modules()], "logits": logits,
            "state": {k: v.clone() for k, v in bb.model.state_dict().items()},
            "forward": type(bb.model).forward is bb.model.forward.__func__,
            "tp": getattr(bb.model.config, "pretraining_tp", None)}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_tiny(tmp_path, capsys, monkeypatch):
    bb = tiny("tiny-llama")
    monkeypatch.setattr(bench, "load_backbone", lambda name, **kw: bb)  # the shared instance, to check it after
    before = snapshot(bb)
    path = tmp_path / "b.json"
    res = bench.main(["--backbone", "tiny-llama", "--repeats", "2", "--warmup", "0", "--seq-len", "16",
                      "--batch-size", "2", "--json", str(path)])
    out = capsys.readouterr().out

    table = {m[0]: m[1:] for m in re.findall(r"^\| ([\w-]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)-([\d.]+) \| "
                                             r"[\d.]+ \|$", out, re.M)}
    assert list(table) == ROWS
    for name, (n, median, ratio, lo, hi) in table.items():
        assert float(median) >= 0 and float(ratio) > 0 and float(lo) <= float(ratio) <= float(hi), name
    assert table["floor"][0] == "0" and float(table["floor"][2]) == 1.0
    assert int(table["capt"][0].replace(",", "")) == bb.n_layers * bb.hidden_size  # L*d
    parts = dict(re.findall(r"^\| (floor-[a-z]+-1|capt-layer0) \| [\d.]+ \| ([\d.]+) \| [\d.-]+ \| [\d.]+ \|$", out,
                            re.M))
    assert list(parts) == ["floor-plus-1", "floor-minus-1", "capt-layer0"]
    assert all(float(v) > 0 for v in parts.values())
    hooks = re.search(r"^capt / floor-plus-1 .*: ([\d.]+)x$", out, re.M)
    assert hooks and float(hooks[1]) > 0
    layers = re.search(r"^capt / capt-layer0 .*: ([\d.]+)x$", out, re.M)
    assert layers and float(layers[1]) > 0
    pred = re.search(r"^\| ratio \| ([\d.]+) \|$", out, re.M)
    assert pred and float(pred[1]) > 0
    assert "CaPT step <= 1.03x floor: " in out and "prediction with capsule <= 1.05x without: " in out
    assert re.findall(r": (PASS|FAIL) \(", out) and len(re.findall(r": (PASS|FAIL) \(", out)) == 2
    assert len(re.findall(r"x; 95 % interval \d\.\d{3}-\d\.\d{3}", out)) == 2   # each verdict with its interval

    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(res))
    assert saved["code"]["torch"] == torch.__version__ and saved["code"]["capt"] == capt.__version__
    assert [r["name"] for r in saved["rows"]] == ROWS
    for r in saved["rows"]:
        n, median, ratio, lo, hi = table[r["name"]]
        assert int(n.replace(",", "")) == r["trainable"]
        assert [float(lo), float(hi)] == pytest.approx(r["ratio_interval"], abs=6e-4)   # JSON keeps it as a list
        assert r["ratio_interval"] == list(bench.ratio_interval(saved["times"][r["name"]], saved["times"]["floor"]))
        assert math.isclose(float(ratio), r["ratio"], abs_tol=6e-4) and r["ratio"] > 0
        assert len(saved["times"][r["name"]]) == 2
        assert math.isclose(r["ratio"], bench.paired_ratio(saved["times"][r["name"]], saved["times"]["floor"]))
        assert math.isclose(r["ratio_of_medians"], r["median_s"] / saved["rows"][0]["median_s"])
    assert math.isclose(float(pred[1]), saved["predict"]["ratio"], abs_tol=6e-4)
    assert math.isclose(saved["capt_vs_floor_plus_1"], bench.paired_ratio(saved["times"]["capt"],
                                                                          saved["times"]["floor-plus-1"]))
    assert math.isclose(saved["capt_vs_capt_layer0"], bench.paired_ratio(saved["times"]["capt"],
                                                                         saved["times"]["capt-layer0"]))
    for r in saved["diagnostic"]:
        assert math.isclose(float(parts[r["name"]]), r["ratio"], abs_tol=6e-4)
        assert len(saved["times"][r["name"]]) == 2

    after = snapshot(bb)
    assert after["hooks"] == before["hooks"]
    assert after["grad"] == before["grad"] and not any(after["grad"])
    assert after["training"] == before["training"]
    assert after["forward"] and after["tp"] == before["tp"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert torch.equal(after["logits"], before["logits"])


def test_measure_counts_and_warmup():
    calls = []
    times = bench.measure(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_measure_waits_for_the_device_before_and_after_each_timed_call():
    """On a GPU the kernels run asynchronously: the clock must start and stop on a synchronized device."""
    log = []
    bench.measure(lambda: log.append("call"), repeats=2, warmup=1, sync=lambda: log.append("sync"))
    assert log == ["call", "sync", "call", "sync", "sync", "call", "sync"]
    assert bench.synchronizer(torch.device("cuda")) is torch.cuda.synchronize   # looked up, not called
    bench.synchronizer(torch.device("cpu"))()   # a no-op


def test_device_and_dtype_reach_the_backbone_and_the_results(monkeypatch, capsys):
    bb, asked = tiny("tiny-llama"), []
    monkeypatch.setattr(bench, "load_backbone", lambda name, **kw: asked.append(kw) or bb)
    res = bench.main(["--backbone", "tiny-llama", "--repeats", "1", "--warmup", "0", "--seq-len", "8",
                      "--batch-size", "2", "--device", "cpu", "--dtype", "float32"])
    assert asked == [{"dtype": "float32", "device": "cpu", "random_weights": False}]
    assert res["device"] == "cpu" and res["dtype"] == "float32"
    machine = describe_machine()   # the CPU and its vector instructions: times depend on them
    assert res["machine"] == machine
    assert capsys.readouterr().out.startswith(f"Backbone tiny-llama: batch 2 x 8 tokens, median of 1 round-robin "
                                              f"repeats (0 warmup), {torch.get_num_threads()} threads on "
                                              f"{machine['cpu']} ({machine['isa']})\n")
    older = dict(res, device=None, dtype=None, machine=None)   # JSON from before train.bench recorded them
    assert bench.format_table(older).split("\n")[0].endswith(f", {torch.get_num_threads()} threads")
    gpu = dict(res, device="cuda:0 (NVIDIA H200)", dtype="bfloat16")
    assert bench.format_table(gpu).startswith("Backbone tiny-llama: batch 2 x 8 tokens, median of 1 round-robin "
                                              "repeats (0 warmup), cuda:0 (NVIDIA H200), bfloat16\n")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_every_row_runs_in_bfloat16():
    """What a GPU user would time: the same rows with the backbone, capsule and PEFT prompts in bfloat16."""
    res = bench.main(["--backbone", "tiny-llama", "--dtype", "bfloat16", "--repeats", "1", "--warmup", "0",
                      "--seq-len", "8", "--batch-size", "2"])
    assert res["dtype"] == "bfloat16" and [r["name"] for r in res["rows"]] == ROWS
    assert all(t[0] > 0 for t in res["times"].values())


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_profile_names_the_ops_behind_the_difference(tmp_path, capsys, monkeypatch):
    """--profile: each profiled row's own op times per step; the capsule's slot write shows up in capt only."""
    bb = tiny("tiny-llama")
    monkeypatch.setattr(bench, "load_backbone", lambda name, **kw: bb)
    res = bench.main(["--backbone", "tiny-llama", "--repeats", "2", "--warmup", "1", "--seq-len", "8",
                      "--batch-size", "2", "--profile", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    ops = res["profile"]
    assert list(ops) == list(bench.PROFILED) and json.loads((tmp_path / "p.json").read_text())["profile"] == ops
    assert ops["capt"]["aten::scatter_"] > 0 and "aten::scatter_" not in ops["floor"]
    assert ops["capt"]["Optimizer.step#AdamW.step"] > 0 and "Optimizer.step#AdamW.step" not in ops["floor"]
    header = "| op: own time per step, ms (torch.profiler) | floor | floor-plus-1 | capt-layer0 | capt | capt - floor |"
    assert header in out
    total = re.search(r"^\| \*\*all ops\*\* \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| ([+-][\d.]+) \|$", out, re.M)
    assert total and float(total[1]) == pytest.approx(sum(ops["floor"].values()), abs=0.06)
    assert float(total[3]) == pytest.approx(float(total[2]) - float(total[1]), abs=0.11)
    table = out[out.index(header):].splitlines()
    rows = table[2:table.index(next(line for line in table if line.startswith("| **all ops**")))]
    diffs = [abs(float(line.rsplit("|", 2)[1])) for line in rows]   # op names may hold spaces and colons
    assert diffs == sorted(diffs, reverse=True) and len(diffs) == 15   # the largest differences first
    assert "profile" not in bench.main(["--backbone", "tiny-llama", "--repeats", "1", "--warmup", "0",
                                        "--seq-len", "8", "--batch-size", "2"])


def test_a_bad_device_or_dtype_is_refused_before_anything_loads():
    for args, message in [(["--device", "nonsense"], "device 'nonsense' is not valid; give cpu, cuda"),
                          (["--dtype", "float8"], "dtype='float8' is not valid; choose one of: float32"),
                          (["--device", "cuda:7"], "device 'cuda:7' (is not available|does not exist)")]:
        with pytest.raises(SystemExit, match=message):
            bench.main(["--backbone", "tiny-llama", "--repeats", "1", *args])


def test_round_robin_interleaves():
    order = []
    fns = {k: (lambda b, k=k: order.append((k, b))) for k in "abc"}
    times = bench.round_robin(fns, batches=[0, 1, 2], warmup=1)
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2, "c": 2}
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]


def test_diagnostic_rows_change_only_what_they_say():
    """floor-plus-1 adds one real token in front of each row, floor-minus-1 drops the first."""
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = (ids, torch.ones_like(ids), torch.tensor([0, 1]))
    ids2, mask2, y2 = bench.plus_one(batch)
    assert ids2.tolist() == [[5, 5, 6, 7], [8, 8, 9, 10]] and mask2.shape == (2, 4) and mask2.all()
    assert y2 is batch[2]
    ids3, mask3, y3 = bench.minus_one(batch)
    assert ids3.tolist() == [[6, 7], [9, 10]] and mask3.shape == (2, 2) and y3 is batch[2]


def test_ratio_interval_shows_how_far_the_noise_leaves_the_ratio_open():
    """The bootstrap interval holds the paired ratio, is the same on every call (seeded), has no width when
    every round agrees, widens with noisier rounds, and a target inside it is reported as undecided."""
    floor = [1.0] * 11
    steady = [1.02] * 11
    noisy = [1.02, 0.95, 1.10, 1.00, 1.15, 0.93, 1.05, 1.20, 0.98, 1.02, 1.08]
    assert bench.ratio_interval(steady, floor) == pytest.approx((1.02, 1.02))
    lo, hi = bench.ratio_interval(noisy, floor)
    assert lo <= bench.paired_ratio(noisy, floor) <= hi and hi - lo > 0.03
    assert bench.ratio_interval(noisy, floor) == (lo, hi)
    slightly = [1.02 + 0.001 * (i % 3) for i in range(11)]
    assert 0 < bench.ratio_interval(slightly, floor)[1] - bench.ratio_interval(slightly, floor)[0] < hi - lo
    row = {"ratio": 1.02, "ratio_interval": (lo, hi)}
    assert "does not decide it" in bench._decides(row, 1.03)
    assert bench._decides({"ratio": 1.02, "ratio_interval": (1.01, 1.025)}, 1.03) == "; 95 % interval 1.010-1.025"


def test_paired_ratio_is_the_median_of_per_round_ratios():
    """A round spoiled for one method (its 2x) moves the median of the ratios less than a ratio of medians."""
    floor = [1.0, 2.0, 1.0, 1.0, 1.0]
    method = [1.02, 2.04, 2.02, 1.02, 1.02]   # 1.02x the floor every round, but round 2 was spoiled for it
    assert bench.paired_ratio(method, floor) == pytest.approx(1.02)
    assert bench.paired_ratio([3.0, 1.0], [1.0, 1.0]) == pytest.approx(2.0)   # even count: the mean of the middle two


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_on_a_tasks_own_padded_batches(capsys, monkeypatch):
    """--task times the batches training builds (length buckets, padding), names their lengths, and fails
    before loading anything for an unknown task."""
    bb = tiny("tiny-llama")
    monkeypatch.setattr(bench, "load_backbone", lambda name, **kw: bb)
    res = bench.main(["--backbone", "tiny-llama", "--task", "rte", "--repeats", "2", "--warmup", "0",
                      "--batch-size", "3"])
    out = capsys.readouterr().out
    batches = bench.task_batches(bb, "rte", 2, 3, 0)
    assert res["batch_lengths"] == sorted(m.shape[1] for _, m, _ in batches)
    assert any(not m.all() for _, m, _ in batches), "length-bucketed batches still carry some padding"
    assert out.startswith(f"Backbone tiny-llama: rte training batches of 3, padded to {res['batch_lengths'][0]}-")
    assert all(r["ratio"] > 0 for r in res["rows"])
    with pytest.raises(SystemExit, match="unknown task 'nope'"):
        bench.main(["--backbone", "no-such-backbone", "--task", "nope"])


def test_losses_read_each_rows_last_real_token(monkeypatch):
    """With padding on either side, the floor and CaPT losses read the label words at each row's last real
    token: the same loss as the row scored alone, unpadded."""
    from capt.scoring import pad

    bb = tiny("tiny-llama")
    cap = capt.Capsule.for_backbone(bb, seed=0)
    rows = [[5, 6, 7, 8, 9], [10, 11, 12]]
    y = torch.tensor([0, 1])
    alone = [bench.capt_loss(bb, cap, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), [3, 4], y[i:i + 1])
             for i, r in enumerate(rows)]
    floor_alone = [bench.floor_loss(bb, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), [3, 4],
                                    y[i:i + 1]) for i, r in enumerate(rows)]
    for side in ("left", "right"):
        ids, mask = pad(rows, 0, side)
        with torch.no_grad():
            assert torch.allclose(bench.capt_loss(bb, cap, ids, mask, [3, 4], y), sum(alone) / 2, atol=1e-5)
            assert torch.allclose(bench.floor_loss(bb, ids, mask, [3, 4], y), sum(floor_alone) / 2, atol=1e-5)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_pool_takes_every_round_of_several_runs_together(tmp_path, capsys, monkeypatch):
    """--pool re-reads --json runs: each round stays paired with its own floor, repeats add up, and runs
    of another set-up are refused by name."""
    bb = tiny("tiny-llama")
    monkeypatch.setattr(bench, "load_backbone", lambda name, **kw: bb)
    args = ["--backbone", "tiny-llama", "--repeats", "2", "--warmup", "0", "--seq-len", "8", "--batch-size", "2"]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    runs = [bench.main(args + ["--json", str(p)]) for p in paths]
    capsys.readouterr()
    pooled = bench.main(["--pool", *map(str, paths)])
    out = capsys.readouterr().out
    assert out.startswith("Backbone tiny-llama: batch 2 x 8 tokens, 4 round-robin rounds pooled from 2 runs")
    assert pooled["repeats"] == 4 and pooled["pooled"] == [str(p) for p in paths]
    floor = runs[0]["times"]["floor"] + runs[1]["times"]["floor"]
    capt_times = runs[0]["times"]["capt"] + runs[1]["times"]["capt"]
    assert pooled["rows"][1]["ratio"] == pytest.approx(bench.paired_ratio(capt_times, floor))
    assert [r["trainable"] for r in pooled["rows"]] == [r["trainable"] for r in runs[0]["rows"]]
    other = tmp_path / "c.json"
    bench.main(args[:-2] + ["--batch-size", "3", "--json", str(other)])
    with pytest.raises(SystemExit, match="c.json is not a run of the same benchmark"):
        bench.main(["--pool", str(paths[0]), str(other)])
    gpu = tmp_path / "gpu.json"   # the same set-up timed on another device
    gpu.write_text(json.dumps(dict(runs[0], device="cuda:0 (NVIDIA H200)")))
    with pytest.raises(SystemExit, match="gpu.json is not a run of the same benchmark.*device, dtype"):
        bench.main(["--pool", str(paths[0]), str(gpu)])
    elsewhere = tmp_path / "elsewhere.json"   # the same set-up timed on another CPU
    other_isa = "AVX2" if runs[0]["machine"]["isa"] != "AVX2" else "AVX512"   # whatever this CPU is not
    elsewhere.write_text(json.dumps(dict(runs[0], machine=dict(runs[0]["machine"], isa=other_isa))))
    with pytest.raises(SystemExit, match="elsewhere.json is not a run of the same benchmark.*dtype, machine"):
        bench.main(["--pool", str(paths[0]), str(elsewhere)])
    with pytest.raises(SystemExit, match="cannot read benchmark results"):
        bench.main(["--pool", str(tmp_path / "missing.json")])
    old = json.loads(paths[0].read_text())
    del old["times"]["capt-layer0"]   # as written before that diagnostic existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="old.json has no capt-layer0 timings: an older train.bench wrote it"):
        bench.main(["--pool", str(tmp_path / "old.json"), str(tmp_path / "old.json")])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_random_weights_time_an_architecture_from_its_config_alone(tmp_path, capsys):
    """--random-weights on a folder holding only a config and a tokenizer: the run says so in its header and
    JSON, and --pool refuses to mix it with a run on real weights."""
    real = tiny("tiny-llama")
    folder = tmp_path / "arch"
    real.model.config.save_pretrained(folder)
    real.tokenizer.save_pretrained(folder)
    args = ["--repeats", "1", "--warmup", "0", "--seq-len", "8", "--batch-size", "2"]
    with pytest.raises(SystemExit, match="could not load the weights"):
        bench.main(["--backbone", str(folder), *args])
    res = bench.main(["--backbone", str(folder), "--random-weights", *args, "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert out.startswith(f"Backbone {folder} (seeded random weights): batch 2 x 8 tokens")
    assert res["random_weights"] is True and json.loads((tmp_path / "r.json").read_text())["random_weights"]
    assert res["rows"][1]["trainable"] == real.n_layers * real.hidden_size
    other = bench.main(["--backbone", str(folder), "--random-weights", *args])
    plain_path = tmp_path / "p.json"   # the same run without the marker: what a run on real weights writes
    plain_path.write_text(json.dumps({k: v for k, v in other.items() if k != "random_weights"}))
    with pytest.raises(SystemExit, match="p.json is not a run of the same benchmark.*random_weights"):
        bench.main(["--pool", str(tmp_path / "r.json"), str(plain_path)])
    assert bench.main(["--pool", str(tmp_path / "r.json"), str(tmp_path / "r.json")])["random_weights"] is True


# --- --cuda-graphs, checked as far as a CPU can: what would stop a capture, and the replay plumbing ---------

class NoHostSync(TorchDispatchMode):
    """Refuses what CUDA graph capture refuses and a CPU run can see: reading a tensor's value on the host
    (.item(), bool(t), `if t.any()`), and ops whose output size depends on values (nonzero, boolean indexing,
    masked_select). A CPU run cannot see a CPU -> GPU copy; those are checked on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool
            for a in args if isinstance(a, (list, tuple)) for t in a)
        if name in ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal",
                    "unique", "_unique2") or boolean_index:
            raise AssertionError(f"{func} reads a tensor's value on the host: not capturable")
        return func(*args, **(kwargs or {}))


def fake_capture(monkeypatch, captured):
    """bench.capture on a CPU: body() runs once as a capture would (under NoHostSync, with capture-aware code
    told a capture is on: ours, capt.capsule.capturing, and transformers', which asks
    torch.cuda.is_current_stream_capturing), and the replay calls body() again, as a replay reruns its
    kernels on the same buffers."""
    import capt.capsule as capsule_module

    def capture(body, device, warmup=3):
        with monkeypatch.context() as m:
            m.setattr(capsule_module, "capturing", lambda: True)
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            with NoHostSync():
                body()
        captured.append(body)
        return body
    monkeypatch.setattr(bench, "capture", capture)


def test_no_host_sync_catches_what_capture_refuses():
    """The checker itself can fail: build_inputs' empty-input check reads a value unless a capture is on."""
    bb = tiny("tiny-llama")
    ids = torch.arange(4, 12)[None]
    with pytest.raises(AssertionError, match="not capturable"), NoHostSync():
        capt.capsule.build_inputs(bb, None, ids, torch.ones_like(ids))
    with pytest.raises(AssertionError, match="not capturable"), NoHostSync():
        ids[:, ids[0] > 5]


def test_a_graphed_step_copies_each_batch_into_its_buffers_and_leaves_the_batch_alone(monkeypatch):
    seen, captured = [], []
    fake_capture(monkeypatch, captured)
    first = (torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([0]))
    step = bench.graphed(lambda b: seen.append([t.clone() for t in b]), first, torch.device("cpu"))
    second = (torch.tensor([[7, 8, 9]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([1]))
    step(second)
    assert len(captured) == 1 and len(seen) == 2                    # captured once, replayed once
    assert all(torch.equal(a, b) for a, b in zip(seen[0], first))  # the capture ran on a copy of the first
    assert all(torch.equal(a, b) for a, b in zip(seen[1], second))  # the replay read the second
    assert torch.equal(first[0], torch.tensor([[1, 2, 3]]))         # which was copied, not written into


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_cuda_graphs_capture_every_row_with_no_host_sync(tmp_path, capsys, monkeypatch):
    """The whole --cuda-graphs path on a CPU with bench.capture faked (fake_capture): every row's step runs
    under NoHostSync with capturing() true, so nothing in floor, CaPT (build_inputs, the hooks, the loss,
    backward) or prediction would stop a capture; trainable rows ask AdamW for capturable=True (on a CPU
    AdamW cannot be capturable, so it is built without, and its own step is left out of the check)."""
    bb = tiny("tiny-llama")
    monkeypatch.setattr(bench, "load_backbone", lambda name, **kw: bb)
    monkeypatch.setattr(bench, "check_graphable", lambda *a: None)   # tested below; this CPU has no CUDA
    captured, asked = [], []
    fake_capture(monkeypatch, captured)
    real_step = bench.train_step

    def train_step(loss_fn, params, capturable=False):
        asked.append((len(params) > 0, capturable))
        step = real_step(loss_fn, params)
        if step.optimizer:   # its CPU step reads its step count (.item()): left out of the check
            step.optimizer.step = lambda real=step.optimizer.step: _unchecked(real)
        return step
    monkeypatch.setattr(bench, "train_step", train_step)
    path = tmp_path / "g.json"
    res = bench.main(["--backbone", "tiny-llama", "--repeats", "2", "--warmup", "1", "--seq-len", "12",
                      "--batch-size", "2", "--cuda-graphs", "--json", str(path)])
    out = capsys.readouterr().out
    assert len(captured) == 7                                       # floor, capt, 3 diagnostics, 2 predictions
    assert asked == [(False, False), (True, True), (True, True)]   # the floor's step (shared), capt, capt-layer0
    assert [r["name"] for r in res["rows"]] == ["floor", "capt"]
    assert list(res["left_out"]) == ROWS[2:] and res["cuda_graphs"] is True
    assert out.split("\n")[0].endswith("every step a replayed CUDA graph")
    for name in ROWS[2:]:
        assert re.search(rf"^\| {name} \| left out: PEFT copies a CPU tensor to the GPU", out, re.M)
    assert all(len(t) == 2 for t in res["times"].values())
    eager = bench.main(["--backbone", "tiny-llama", "--repeats", "1", "--warmup", "0", "--seq-len", "12",
                        "--batch-size", "2", "--json", str(tmp_path / "e.json")])
    assert "cuda_graphs" not in eager                               # eager runs' JSON stays as before
    with pytest.raises(SystemExit, match="not a run of the same benchmark"):
        bench.main(["--pool", str(path), str(tmp_path / "e.json")])
    pooled = bench.main(["--pool", str(path), str(path)])
    assert pooled["cuda_graphs"] is True and pooled["left_out"] == res["left_out"]


def _unchecked(fn):
    """fn() with any NoHostSync mode above it switched off (the CPU optimizer step)."""
    with _disable_current_modes():
        return fn()


def test_cuda_graphs_are_refused_clearly_where_they_cannot_run(monkeypatch):
    monkeypatch.setattr(bench, "load_backbone", lambda *a, **kw: pytest.fail("loaded before refusing"))
    base = ["--backbone", "tiny-llama", "--repeats", "1", "--cuda-graphs"]
    with pytest.raises(SystemExit, match="every batch needs the same shape: use the default random rows"):
        bench.main([*base, "--task", "rte"])
    with pytest.raises(SystemExit, match="give one of --profile and --cuda-graphs"):
        bench.main([*base, "--profile"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU; the device here is cpu"):
        bench.main([*base, "--device", "cpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU; the device here is cpu"):
            bench.main(base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_replayed_cuda_graph_computes_what_the_eager_step_computes():
    """On a GPU: capt's loss and backward captured once (bench.capture) and replayed on two batches give W the
    eager step's gradient on each (close, not bitwise: under capture transformers passes SDPA an explicit mask
    where eagerly it passes is_causal, so another attention kernel may run)."""
    bb = capt.load_backbone("tiny-llama", device="cuda")
    label_ids = torch.tensor([5, 6], device=bb.device)
    capsule = capt.Capsule.for_backbone(bb, seed=0)
    first, second = bench.make_batches(bb, 2, 4, 16, 0)

    def eager(b):
        capsule.weight.grad = None
        bench.capt_loss(bb, capsule, b[0], b[1], label_ids, b[2]).backward()
        return capsule.weight.grad.clone()

    static, out = tuple(t.clone() for t in first), {}

    def body():
        capsule.weight.grad = None
        bench.capt_loss(bb, capsule, *static[:2], label_ids, static[2]).backward()
        out["grad"] = capsule.weight.grad

    replay = bench.capture(body, bb.device)
    grads = []
    for b in (first, second):
        for buffer, t in zip(static, b):
            buffer.copy_(t)
        replay()
        torch.cuda.synchronize()
        grads.append(out["grad"].clone())
        torch.testing.assert_close(grads[-1], eager(b), rtol=1e-3, atol=1e-5)
    assert not torch.allclose(grads[0], grads[1])   # the replay read the second batch


GPU_CHECK = ["bash", str(Path(__file__).resolve().parents[1] / "train" / "gpu_check.sh")]


def test_the_gpu_check_script_says_how_to_call_it():
    res = subprocess.run(GPU_CHECK, capture_output=True, text=True)
    assert res.returncode == 2
    assert "bash train/gpu_check.sh run OUT [KIT]" in res.stdout and "--dry-run" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_check_script_refuses_a_machine_without_cuda_and_points_to_the_dry_run(tmp_path):
    res = subprocess.run([*GPU_CHECK, "run", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "no CUDA GPU here: run with --dry-run" in res.stdout
    assert "cuda False" in (tmp_path / "out" / "gpu-check.log").read_text()   # its environment step ran, logged
    assert not list((tmp_path / "out").glob("*.json"))                       # and nothing else did
