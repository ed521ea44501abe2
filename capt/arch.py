"""Where a capsule enters each architecture: one table, no per-model `if` chains.

A capsule needs three things from a backbone: the input-embedding module (to build `inputs_embeds`
ourselves and insert the slot), the list of layers it runs through (forward pre-hooks replace the
slot there), and whether that stack is a T5-style encoder (bidirectional, no position ids: T5 uses
relative position buckets) or a decoder-only LM (causal, rotary positions from `position_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch.nn as nn

from .errors import CaptError


@dataclass(frozen=True)
class ArchSpec:
    embed: str          # dotted path of the input-embedding module (its output is what `inputs_embeds` takes)
    layers: str         # dotted path of the nn.ModuleList the capsule lives in
    encoder_decoder: bool
    position_ids: bool  # whether the forward takes `position_ids` (we derive them from the mask)


_DECODER = ArchSpec("model.embed_tokens", "model.layers", encoder_decoder=False, position_ids=True)

ARCHITECTURES: dict[str, ArchSpec] = {
    # encoder-decoder: the capsule lives in the encoder; the decoder cross-attends to it
    "t5": ArchSpec("encoder.embed_tokens", "encoder.block", encoder_decoder=True, position_ids=False),
    "mt5": ArchSpec("encoder.embed_tokens", "encoder.block", encoder_decoder=True, position_ids=False),
    # decoder-only: every decoder layer. Gemma's embedding module scales by sqrt(d) itself, so calling
    # it gives exactly what the model would compute from input_ids.
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma": _DECODER,
    "gemma2": _DECODER,
    "gemma3_text": _DECODER,
    # multimodal Gemma 3 checkpoints: the text stack sits one level deeper
    "gemma3": ArchSpec("model.language_model.embed_tokens", "model.language_model.layers",
                       encoder_decoder=False, position_ids=True),
}


def arch_of(model: nn.Module) -> ArchSpec:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise CaptError(f"architecture '{model_type}' is not supported; supported: "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type]


def embedding_module(model: nn.Module) -> nn.Module:
    return attrgetter(arch_of(model).embed)(model)


def layer_list(model: nn.Module) -> nn.ModuleList:
    return attrgetter(arch_of(model).layers)(model)
