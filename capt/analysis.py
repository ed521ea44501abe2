"""The paper's training-free probe: one instance-aware token helps, more tokens hurt.

With a trained capsule (the paper uses deep prompt-tuning, i.e. CapsuleConfig(fusion="none") from
`python -m train --method deep-prompt-1`), prepend k mean-pooled instance tokens before it at every
capsule layer - nothing is trained - and measure accuracy for each k (the paper: 1, 2, 3, 4, 10).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from .backbones import Backbone
from .capsule import Capsule
from .config import CapsuleConfig
from .errors import CaptError
from .predict import predict
from .tasks import TASKS, Task, load_examples

PAPER_KS = (1, 2, 3, 4, 10)   # the numbers of pooled tokens the paper's probe tries
MAX_K = 64


def with_pooled_tokens(capsule: Capsule, k: int) -> Capsule:
    """The same trained capsule (shared weights, no copy) with k pooled instance slots before it."""
    probe = Capsule(replace(capsule.config, pooled_tokens=k), capsule.n_layers, capsule.hidden_size,
                    capsule.head.out_features if capsule.head is not None else None, meta=capsule.meta)
    probe.load_state_dict(capsule.state_dict())
    return probe.to(device=capsule.weight.device, dtype=capsule.weight.dtype)


def pooled_token_probe(backbone: Backbone, task: Task, examples: list[dict], capsule: Capsule,
                       ks=(0, 1, 2, 3, 4, 10), batch_size: int = 8) -> dict[int, float]:
    """Accuracy on labelled `examples` for each number k of pooled tokens (k=0: the capsule as trained)."""
    if not ks or not all(0 <= int(k) <= MAX_K for k in ks):
        raise CaptError(f"choose one or more numbers of pooled tokens in 0..{MAX_K} (the paper: {PAPER_KS}), "
                        f"got {list(ks or ())}")
    if not examples or any(e.get("label") is None for e in examples):
        raise CaptError("the probe needs labelled examples")
    golds = [task.label_index(e["label"]) if not isinstance(e["label"], int) else e["label"] for e in examples]
    result = {}
    with torch.no_grad():
        for k in ks:
            preds = predict(backbone, task, examples, capsule=with_pooled_tokens(capsule, int(k)),
                            batch_size=batch_size)
            result[int(k)] = sum(task.labels.index(p.label) == g for p, g in zip(preds, golds)) / len(golds)
    return result


@dataclass
class ProbeResult:
    accuracy: dict[int, float]   # k -> accuracy; k = 0 is the probed capsule as it is
    n_examples: int
    subject: str                 # what was probed: the given capsule (named by its fusion) or the untrained deep prompt
    task: str
    seed: int

    def table(self) -> str:
        """Markdown: accuracy for each k, and the change from k = 0."""
        base = self.accuracy[0]
        rows = [f"| {k} | {100 * a:.1f} | {100 * (a - base):+.1f} |" for k, a in self.accuracy.items()]
        return "\n".join([f"{self.task}: {self.n_examples} val examples (seed {self.seed}), k mean-pooled instance "
                          f"tokens prepended at every capsule layer of {self.subject}, nothing trained", "",
                          "| k | accuracy (%) | vs k = 0 (points) |", "|---:|---:|---:|", *rows])


def probe_on_val(backbone: Backbone, task: Task, capsule: Capsule | None = None, n_examples: int = 32,
                 ks=PAPER_KS, seed: int = 0) -> ProbeResult:
    """The probe as the paper runs it, on a seeded random sample of n_examples of a built-in task's val split:
    accuracy for k = 0 and each k in ks. Without a capsule the probed prompt is an untrained deep prompt
    (CapsuleConfig(fusion="none"), W = 0), so only the pooled tokens carry information."""
    if task not in TASKS.values():
        raise CaptError("the probe measures accuracy on a built-in task's val split; choose one of " + ", ".join(TASKS))
    n = int(n_examples or 0)
    if not 4 <= n <= 1000:
        raise CaptError(f"sample size {n} is out of range; valid: 4..1000 val examples")
    chosen = sorted({int(k) for k in ks or ()})
    if not chosen or not all(1 <= k <= MAX_K for k in chosen):
        raise CaptError(f"choose one or more numbers of pooled tokens in 1..{MAX_K} (the paper: {PAPER_KS})")
    fusion = capsule.config.fusion if capsule is not None else None
    subject = "the given deep prompt (fusion='none')" if fusion == "none" else f"the given capsule (fusion='{fusion}')"
    if capsule is None:
        capsule = Capsule.for_backbone(backbone, CapsuleConfig(fusion="none"), n_labels=len(task.labels))  # W = 0
        subject = "an untrained deep prompt (W = 0: only the pooled tokens carry information)"
    val = load_examples(task, "val")
    examples = random.Random(seed).sample(val, min(n, len(val)))
    accuracy = pooled_token_probe(backbone, task, examples, capsule, ks=[0, *chosen])
    return ProbeResult(accuracy, len(examples), subject, task.name, seed)
