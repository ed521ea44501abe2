"""generate(): free text from a prompt, with a capsule or without, through transformers' own `generate`.

The capsule is computed once, in the prefill pass over the prompt (DESIGN.md: "During generation with a KV
cache the capsule is computed once, in the prefill pass"): the slot's keys and values enter the KV cache with
the prompt's and every generated token attends to them, while the decoding steps pass the capsule's hooks
untouched (each hook acts once per call: `capt.capsule._make_hook`). So a generated token sees exactly what a
full forward over prompt + generated text would show it with the capsule's instance mean taken over the prompt
alone (tested).
T5: the encoder runs once with the capsule and `generate` decodes from its output.

Classification never generates: `predict` scores the label set only. This is for what else a capsule is
used for (a task's own free-text answers, or looking at what a capsule does to the backbone's text).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .backbones import Backbone
from .capsule import Capsule, attached, build_inputs
from .errors import CaptError
from .scoring import _device, encode_prompts, pad

MAX_NEW_TOKENS = 4096
# generate's own arguments that this function sets from the prompt and the capsule
OWN = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "encoder_outputs", "past_key_values",
       "cache", "max_length")


@dataclass
class Generation:
    text: str                   # the new text (the prompt not repeated), special tokens left out
    token_ids: list[int]        # the new tokens, up to and without the end-of-sequence token
    truncated: bool             # the prompt was longer than the backbone's limit and was cut
    dropped_tokens: int         # how many prompt tokens were cut

    def to_dict(self) -> dict:
        return asdict(self)


def generate(backbone: Backbone, prompts: str | list[str], capsule: Capsule | None = None,
             max_new_tokens: int = 32, **generate_kwargs) -> Generation | list[Generation]:
    """The backbone's continuation of each prompt (a str, or a list: one batch, left-padded) with the
    capsule attached for the prefill; capsule=None gives the bare backbone, for a side-by-side view.

    Greedy by default; any other argument goes to transformers' `generate` (do_sample=True, temperature,
    top_p, repetition_penalty, ...). Decoder-only models decode one sequence per prompt (num_beams and
    num_return_sequences 1: the capsule's prefill is per prompt; repeat a prompt in the list for more).
    A capsule's linear head, if it has one, plays no part: the text comes from the backbone's LM head.
    """
    single = isinstance(prompts, str)
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise CaptError("nothing to generate from: give a prompt or a non-empty list of prompts")
    for p in batch:
        if not isinstance(p, str) or not p.strip():
            raise CaptError(f"every prompt must be non-empty text, got {p!r}")
    if not (isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= MAX_NEW_TOKENS):
        raise CaptError(f"max_new_tokens={max_new_tokens!r} is out of range; valid: an integer 1..{MAX_NEW_TOKENS}")
    own = sorted(set(generate_kwargs) & set(OWN))
    if own:
        raise CaptError(f"{', '.join(own)}: set by capt.generate from the prompts and the capsule; give the "
                        "prompts as text and max_new_tokens for the length")
    many = {k: generate_kwargs[k] for k in ("num_beams", "num_return_sequences") if generate_kwargs.get(k, 1) != 1}
    if many and not backbone.encoder_decoder:
        raise CaptError(f"{many}: a decoder-only backbone decodes one sequence per prompt here (the capsule's "
                        "prefill is made per prompt); valid: 1, and repeat a prompt in the list to sample it again")
    tok = backbone.tokenizer
    pad_id = tok.pad_token_id   # load_backbone gives every tokenizer one (its EOS where it has none)
    # decoder-only: the new tokens share the model's limit with the prompt; T5's decoder has its own
    ids, dropped = encode_prompts(backbone, capsule, batch, reserve=0 if backbone.encoder_decoder else max_new_tokens)
    input_ids, mask = _device(backbone, *pad(ids, pad_id, "right" if backbone.encoder_decoder else "left"))
    inputs = build_inputs(backbone, capsule, input_ids, mask)
    model = backbone.model
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad_id, **generate_kwargs}
    with torch.no_grad(), backbone.lock, attached(backbone, capsule, inputs.call):
        if backbone.encoder_decoder:
            enc = model.encoder(inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask)
            out = model.generate(encoder_outputs=enc, attention_mask=inputs.attention_mask, **kwargs)
            out = out[:, 1:]                     # the decoder's start token
        else:
            out = model.generate(inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask,
                                 position_ids=inputs.position_ids, **kwargs)   # only the new tokens come back
    eos = _eos_ids(model, tok)
    results = []
    per_prompt = len(out) // len(batch)         # T5 may return several sequences per prompt, in prompt order
    for row, n in zip(out.tolist(), [d for d in dropped for _ in range(per_prompt)]):
        end = next((i for i, t in enumerate(row) if t in eos), len(row))
        new = row[:end]
        results.append(Generation(text=tok.decode(new, skip_special_tokens=True), token_ids=new,
                                  truncated=n > 0, dropped_tokens=n))
    return results[0] if single and len(results) == 1 else results


def _eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a sequence: the generation config's (one or a list) and the tokenizer's."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
