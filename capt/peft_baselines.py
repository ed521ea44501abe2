"""The PEFT baselines: prompt tuning (m soft tokens before the input embeddings) and P-tuning v2
(PEFT prefix tuning without projection: an m-token K/V prefix at every attention layer).

Both score the label set exactly like capt.scoring (same truncation, padding and label semantics);
only the forward goes through PEFT's wrapper. What PEFT does to the base model, and why it is safe:
`get_peft_model` keeps the shared model as `peft_model.base_model` (a child module), sets
requires_grad=False on all of its parameters, sets `config.pretraining_tp = 1`, and would hook the
input embeddings if gradient checkpointing were on. The backbone is frozen, without checkpointing, so
the first two are no-ops, and we restore both anyway. The lasting risk is the child link: `.train()`,
`.to()` or `.half()` on the wrapper would reach the shared model, so the wrapper stays outside this
Method's module tree and only its prompt encoder is registered here.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .backbones import Backbone
from .errors import CaptError
from .seeding import seeded
from .files import atomic_folder
from .io import task_to_dict
from .methods import Method
from .scoring import (Scores, _device, _last_real, check_batch, encode_prompts, label_rows, label_tokens, pad,
                      t5_targets, t5_totals)
from .tasks import Rendered, Task

KINDS = ("prompt-tuning", "p-tuning-v2")


class PeftMethod(Method):
    """A PEFT prompt-learning baseline on a shared, frozen backbone; `name` is one of KINDS."""

    artifact = "adapter"  # a PEFT adapter folder, not a capsule

    def __init__(self, backbone: Backbone, task: Task, name: str, num_virtual_tokens: int = 20, seed: int = 0):
        super().__init__(backbone, task)
        from peft import PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model

        if name not in KINDS:
            raise CaptError(f"unknown PEFT baseline {name!r}; valid: {', '.join(KINDS)}")
        if num_virtual_tokens < 1:
            raise CaptError(f"num_virtual_tokens must be at least 1, got {num_virtual_tokens}")
        self.name, self.m = name, num_virtual_tokens
        task_type = TaskType.SEQ_2_SEQ_LM if backbone.encoder_decoder else TaskType.CAUSAL_LM
        if name == "prompt-tuning":
            # seq2seq defaults to 2 "submodules", i.e. 2m embeddings of which PEFT's forward reads only
            # the first m (the encoder's); one submodule keeps n_trainable = m*d honest.
            config = PromptTuningConfig(task_type=task_type, num_virtual_tokens=self.m, num_transformer_submodules=1)
        else:
            # Caveat (PEFT 0.21, T5): the prefix reaches only the decoder's self-attention. PEFT tiles its
            # 2L K/V rows twice into (self K, self V, cross K, cross V) per layer and then drops the cross
            # part, so for even L (t5-base, t5-large) half the numbers never get a gradient and decoder
            # layers i and i + L/2 share one prefix. We keep PEFT's layout and count, as shipped.
            config = PrefixTuningConfig(task_type=task_type, num_virtual_tokens=self.m)
        model = backbone.model
        with backbone.lock:
            flags = [(p, p.requires_grad) for p in model.parameters()]
            tp = getattr(model.config, "pretraining_tp", None)
            had_tp = hasattr(model.config, "pretraining_tp")
            with seeded(seed), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # PEFT reads a deprecated transformers property
                peft_model = get_peft_model(model, config)
            for p, flag in flags:
                p.requires_grad_(flag)
            if had_tp:
                model.config.pretraining_tp = tp
            elif hasattr(model.config, "pretraining_tp"):
                delattr(model.config, "pretraining_tp")
        self.peft = [peft_model]                         # a list keeps the wrapper (and the backbone) unregistered
        self.prompt_encoder = peft_model.prompt_encoder  # the only trainable tensors, shared with the wrapper
        self.prefix = self.m if name == "prompt-tuning" else 0  # extra positions in the returned logits

    def scores(self, rendered: list[Rendered], general: bool = False) -> Scores:
        """(B, C) label log-scores. `general` forces the per-(example, label) path (tests)."""
        check_batch(rendered)
        if self.bb.encoder_decoder:
            return self._score_t5(rendered)
        return self._score_decoder(rendered, general)

    # --- decoder-only --------------------------------------------------------------------------

    def _log_probs(self, ids: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """(N, T) ids, mask and a bool `keep` -> (K, V) next-token log-probs at the K kept positions,
        row-major. The LM head runs only on those (transformers' boolean `logits_to_keep`)."""
        if self.prefix:  # PEFT prepends the virtual tokens, so every real position moves right by m
            keep = torch.cat([keep.new_zeros(keep.shape[0], self.prefix), keep], 1)
        ids, mask, keep = (t.to(self.bb.device) for t in (ids, mask, keep))
        with self.bb.lock:
            logits = self.peft[0](input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
        return torch.log_softmax(logits.float(), -1)

    def _score_decoder(self, rendered, general) -> Scores:
        tok = self.bb.tokenizer
        side = tok.padding_side  # with left padding PEFT's virtual tokens precede the pads (its behaviour)
        choice_ids, one_token = label_tokens(tok, rendered)
        if one_token and not general:  # one row per example, read at its last real token
            prompts, dropped = encode_prompts(self.bb, None, [r.prompt for r in rendered], reserve=self.m)
            ids, mask = pad(prompts, tok.pad_token_id, side)
            keep = torch.zeros_like(mask, dtype=torch.bool)
            keep[torch.arange(len(prompts)), _last_real(mask)] = True
            logp = self._log_probs(ids, mask, keep)                             # (B, V)
            return Scores(logp[:, [c[0] for c in choice_ids[0]]], dropped)

        reserve = self.m + max(len(c) for row in choice_ids for c in row)   # one row per (example, label)
        prompts, dropped = encode_prompts(self.bb, None, [r.prompt for r in rendered], reserve)
        lr = label_rows(prompts, choice_ids, tok.pad_token_id, side)
        keep = torch.zeros_like(lr.mask, dtype=torch.bool)
        keep[lr.row_of, lr.pos_of] = True                # row-major, ascending per row: the order of lr.target
        logp = self._log_probs(lr.ids, lr.mask, keep)                           # (K, V)
        token_logp = logp.gather(1, lr.target.to(logp.device)[:, None])[:, 0]
        return Scores(lr.totals(token_logp, len(rendered)), dropped)

    # --- encoder-decoder -----------------------------------------------------------------------

    def _score_t5(self, rendered) -> Scores:
        """Each label's target tokens, teacher-forced. PEFT's forward always runs the encoder, so the
        prompt is repeated once per label (C encoder passes instead of capt.scoring's one)."""
        tok, bb = self.bb.tokenizer, self.bb
        prompts, dropped = encode_prompts(bb, None, [r.prompt for r in rendered], reserve=self.m)
        ids, mask = _device(bb, *pad(prompts, tok.pad_token_id, "right"))
        C = len(rendered[0].choices)
        tgt, tmask, dec_in = t5_targets(bb, rendered)
        with bb.lock:
            logits = self.peft[0](input_ids=ids.repeat_interleave(C, 0), attention_mask=mask.repeat_interleave(C, 0),
                                  decoder_input_ids=dec_in, decoder_attention_mask=tmask).logits  # (B*C, T', V)
        return Scores(t5_totals(torch.log_softmax(logits.float(), -1), tgt, tmask, len(rendered)), dropped)

    # --- files ---------------------------------------------------------------------------------

    def save(self, folder, training, metrics) -> Path:
        """PEFT's own adapter folder (adapter_config.json, adapter_model.safetensors) plus capt.json
        (backbone, task, training, metrics), written to a temp folder that is renamed into place."""
        folder = Path(folder)
        with atomic_folder(folder) as tmp:
            self.peft[0].save_pretrained(str(tmp), safe_serialization=True)
            meta = {"method": self.name, "num_virtual_tokens": self.m, "n_trainable": self.n_trainable(),
                    "backbone": self.bb.describe(), "task": task_to_dict(self.task),
                    "training": training, "metrics": metrics}
            (tmp / "capt.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        return folder
