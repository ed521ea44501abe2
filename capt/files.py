"""Writing a folder all at once: a temporary folder beside it, renamed into place when complete.

Used for capsules, adapters, checkpoints, model cards and the de-quantized backbone cache, so a killed
process never leaves half a folder where a reader expects a whole one.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(folder: Path):
    """Yield a temporary folder beside `folder`; on success it replaces `folder` in one rename (an older
    folder is swapped out only once the new one is complete); on failure nothing is left behind."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a capsule folder is an ordinary folder
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
