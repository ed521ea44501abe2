"""Capsule files: a folder with `capsule.json` (everything needed to rebuild and check it) and
`capsule.safetensors` (only the capsule's own tensors, and the head's if any). No pickle anywhere.

Writes go to a temporary folder that is renamed into place, so a killed run never leaves half a capsule.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__
from .backbones import Backbone
from .capsule import Capsule
from .config import CapsuleConfig
from .errors import CaptError
from .tasks import TASKS, Task, custom_task

CONFIG_FILE = "capsule.json"
WEIGHTS_FILE = "capsule.safetensors"
FORMAT = "capt-capsule"
FORMAT_VERSION = 1


def task_to_dict(task: Task) -> dict:
    return {f.name: getattr(task, f.name) for f in fields(task) if f.name != "lm_render"}


def task_from_dict(d: dict) -> Task:
    """The built-in task when the name is one (its label words must agree), else a custom task."""
    builtin = TASKS.get(d["name"])
    if builtin is not None and list(builtin.labels) == list(d["labels"]):
        return builtin
    words = dict(zip(d.get("raw_labels") or d["labels"], d["lm_words"]))
    return custom_task(d["name"], d["fields"], words, lm_template=d.get("lm_template"),
                       t5_words=d.get("t5_words"))


def save_capsule(capsule: Capsule, folder: str | Path, backbone: Backbone, task: Task | None = None,
                 training: dict | None = None, metrics: dict | None = None) -> Path:
    """Write the capsule folder atomically; returns its path."""
    folder = Path(folder)
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
        "backbone": backbone.describe(),
        "capsule": capsule.config.to_dict(),
        "n_params": capsule.param_report(backbone),
        "task": task_to_dict(task) if task is not None else None,
        "n_labels": capsule.head.out_features if capsule.head is not None else None,
        "training": training or capsule.meta.get("training"),
        "metrics": metrics or capsule.meta.get("metrics"),
    }
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in capsule.state_dict().items()}
    with atomic_folder(folder) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
    return folder


@contextmanager
def atomic_folder(folder: Path):
    """Yield a temporary folder beside `folder`; on success it replaces `folder` in one rename (an older
    folder is swapped out only once the new one is complete); on failure nothing is left behind."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        yield tmp
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_config(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CaptError(f"{folder} is not a capsule folder: it has no {CONFIG_FILE} "
                        f"(a capsule folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CaptError(f"{path} is corrupt: not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CaptError(f"{path} is not a CaPT capsule config (expected \"format\": \"{FORMAT}\")")
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise CaptError(f"{path} has format version {config['format_version']}; this library reads up to "
                        f"{FORMAT_VERSION}: upgrade capt")
    return config


def load_capsule(folder: str | Path, backbone: Backbone | None = None) -> tuple[Capsule, Task | None]:
    """Read a capsule folder; with a backbone, refuse a capsule made for another one.

    Returns (capsule, task) - task is None when the capsule was saved without one.
    """
    folder = Path(folder)
    config = read_config(folder)
    info = config["backbone"]
    if backbone is not None:
        check_backbone(info, backbone)
    cap_config = CapsuleConfig.from_dict(config["capsule"])
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except FileNotFoundError:
        raise CaptError(f"{folder} has no {WEIGHTS_FILE}") from None
    except (SafetensorError, OSError) as e:
        raise CaptError(f"{folder / WEIGHTS_FILE} is corrupt or truncated ({e})") from None
    capsule = Capsule(cap_config, info["n_layers"], info["hidden_size"], config.get("n_labels"),
                      meta={"backbone": info, "training": config.get("training"), "metrics": config.get("metrics")})
    expected = {k: tuple(v.shape) for k, v in capsule.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if expected != found:
        raise CaptError(f"{folder / WEIGHTS_FILE} does not match its {CONFIG_FILE}: tensors {found}, "
                        f"expected {expected}")
    capsule.load_state_dict(tensors)
    if backbone is not None:
        capsule = capsule.to(device=backbone.device, dtype=backbone.dtype)
    task = task_from_dict(config["task"]) if config.get("task") else None
    return capsule, task


def check_backbone(info: dict, backbone: Backbone) -> None:
    """Refuse a capsule saved for another backbone, naming both sides."""
    mine = backbone.describe()
    keys = ("name", "model_type", "n_layers", "hidden_size")
    if any(info.get(k) != mine[k] for k in keys):
        saved = ", ".join(f"{k}={info.get(k)}" for k in keys)
        here = ", ".join(f"{k}={mine[k]}" for k in keys)
        raise CaptError(f"this capsule was trained for backbone ({saved}) but the loaded backbone is "
                        f"({here}); load '{info.get('name')}' to use it")


def push_to_hub(folder: str | Path, repo_id: str, token: str | None = None, private: bool = True) -> str:
    """Upload a capsule folder to a Hub model repo (private by default); returns the repo URL."""
    from huggingface_hub import HfApi

    read_config(folder)  # never push something that is not a capsule
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message="Upload CaPT capsule")
    return str(url)


def pull_from_hub(repo_id: str, revision: str | None = None, token: str | None = None) -> Path:
    """Download a capsule repo (only the capsule files) and return its local folder."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, revision=revision, token=token,
                                 allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, "README.md"])
    except Exception as e:  # offline, missing repo, no access: one clear message
        raise CaptError(f"could not download capsule '{repo_id}' from the hub ({type(e).__name__}: {e})") from None
    return Path(path)
