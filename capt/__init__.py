"""CaPT: Capsule Prompt-Tuning (NeurIPS 2025) on Hugging Face backbones.

    import capt
    bb = capt.load_backbone("smollm2-135m")
    capsule = capt.Capsule.for_backbone(bb)                 # L*d trainable numbers
    capt.predict(bb, "rte", {"premise": "...", "hypothesis": "..."}, capsule=capsule)
    capt.generate(bb, "Some prompt", capsule=capsule, max_new_tokens=32).text   # the capsule set in the prefill
    capt.lm_loss(bb, capsule, input_ids, attention_mask, labels).loss   # free-text training; capt.CapsuleLM: Trainer
    capt.lm_training.train_lm(bb, [("a prompt", " its completion"), ...], "runs/qa")   # the same in one call
    report = capt.attention(bb, "some text", capsule=capsule)
    soft = capt.load_soft_prompt("runs/rte-pt/adapter", bb)   # a trained prompt-tuning soft prompt
    report = capt.attention(bb, "some text", soft_prompt=soft)
"""
__version__ = "0.1.0"

from .errors import CaptError
from .config import CapsuleConfig
from .backbones import Backbone, load_backbone, DEFAULT_BACKBONE, EMBEDDED, HUB_ALIASES, TINY
from .tasks import TASKS, Task, Rendered, get_task, custom_task, load_examples, load_file
from .capsule import Capsule
from .scoring import score
from .predict import Prediction, predict
from .generation import Generation, generate
from .lm import CapsuleLM, LMOutput, lm_loss
from .attention import CAPSULE_TOKEN, SOFT_TOKEN, AttentionReport, attention
from .io import SoftPrompt, load_capsule, load_soft_prompt, save_capsule, push_to_hub, pull_from_hub

__all__ = [
    "CaptError", "CapsuleConfig", "Backbone", "load_backbone", "DEFAULT_BACKBONE", "EMBEDDED", "HUB_ALIASES",
    "TINY", "TASKS", "Task", "Rendered", "get_task", "custom_task", "load_examples", "load_file", "Capsule",
    "score", "Prediction", "predict", "Generation", "generate", "lm_loss", "LMOutput", "CapsuleLM",
    "CAPSULE_TOKEN", "SOFT_TOKEN", "AttentionReport", "attention", "load_capsule", "save_capsule",
    "push_to_hub", "pull_from_hub", "SoftPrompt", "load_soft_prompt",
]
