"""Capsule files: save -> load -> identical predictions; mismatches and corrupt files are refused."""
import json

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
