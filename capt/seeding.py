"""Seeded initialisation that leaves every global random state (CPU and CUDA) as it found it."""
from contextlib import contextmanager

import torch


@contextmanager
def seeded(seed: int | None):
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        yield
