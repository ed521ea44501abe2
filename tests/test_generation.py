"""capt.generate: free text with a capsule computed once in the prefill, on every tiny architecture."""
import re

import pytest
import torch

import capt
from capt.capsule import run
from capt.generation import generate
from capt.scoring import lm_logits
from conftest import OPTIONS, _count_hooks, hooks_at_load, random_capsule, tiny

PROMPTS = ["the cat sat", "a much longer prompt about the dogs and the cats of the town"]
N = 5


def _eos(bb) -> set:
    ids = bb.model.generation_config.eos_token_id
    return set(ids if isinstance(ids, list) else [ids]) | {bb.tokenizer.eos_token_id} - {None}


def _cut(tokens: list[int], eos: set) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def _reference(bb, capsule, prompt: str, n: int) -> list[int]:
    """Greedy decoding with no cache and no transformers `generate`: at every step one full forward over the
    prompt and the tokens so far, the capsule's instance mean over the prompt alone (what the prefill saw);
    T5: the encoder once with the capsule, then the decoder over everything so far."""
    ids = torch.tensor([bb.tokenizer(prompt)["input_ids"]])
    new = []
    with torch.no_grad():
        if bb.encoder_decoder:
            enc, inputs = run(bb, capsule, ids, torch.ones_like(ids))
            start = bb.model.config.decoder_start_token_id
            for _ in range(n):
                dec = torch.tensor([[start] + new])
                out = bb.model(encoder_outputs=(enc.last_hidden_state,), attention_mask=inputs.attention_mask,
                               decoder_input_ids=dec, use_cache=False)
                new.append(int(out.logits[0, -1].argmax()))
            return new
        for _ in range(n):
            full = torch.cat([ids, torch.tensor([new], dtype=torch.long)], 1)
            prompt_only = torch.zeros_like(full)
            prompt_only[:, :ids.shape[1]] = 1
            out, inputs = run(bb, capsule, full, torch.ones_like(full), instance_mask=prompt_only)
            new.append(int(lm_logits(bb, out.last_hidden_state[0, -1]).argmax()))
    return new


@pytest.mark.parametrize("option", ["default", "prepend", "inplace", "odd", "project", "pooled"])
def test_cached_generation_equals_full_forwards_with_the_prompts_mean(backbone, option):
    """The KV-cached generation (the capsule set once, in the prefill) gives, token for token, what greedy
    decoding with a full forward per step gives when the capsule's mean is over the prompt alone; batched
    and left-padded against one prompt at a time, on every architecture and capsule option."""
    cap = random_capsule(backbone, **OPTIONS[option])
    eos = _eos(backbone)
    got = generate(backbone, PROMPTS, capsule=cap, max_new_tokens=N)
    for prompt, g in zip(PROMPTS, got):
        want = _reference(backbone, cap, prompt, N)
        assert g.token_ids == _cut(want, eos), (prompt, g.token_ids, want)
        assert g.text == backbone.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        assert not g.truncated and g.dropped_tokens == 0


def test_a_one_token_prompt_with_the_capsule_in_place(backbone):
    """inplace placement on a one-token prompt: the prompt and each decoding step have the same length,
    so only the prefill-only flag keeps the capsule off the generated tokens."""
    cap = random_capsule(backbone, placement="inplace")
    assert len(backbone.tokenizer("a")["input_ids"]) == 1   # the tiny tokenizer adds no BOS (like Qwen2's)
    got = generate(backbone, "a", capsule=cap, max_new_tokens=N)
    assert got.token_ids == _cut(_reference(backbone, cap, "a", N), _eos(backbone))


def test_without_a_capsule_it_is_the_backbones_own_generate(backbone):
    """capsule=None: exactly transformers' greedy `generate` on the token ids (same batch, same padding)."""
    tok = backbone.tokenizer
    got = generate(backbone, PROMPTS, max_new_tokens=N)
    side = "right" if backbone.encoder_decoder else "left"
    ids, mask = capt.scoring.pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id, side)
    with torch.no_grad():
        out = backbone.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, do_sample=False,
                                      pad_token_id=tok.pad_token_id)
    out = out[:, 1:] if backbone.encoder_decoder else out[:, ids.shape[1]:]
    assert [g.token_ids for g in got] == [_cut(row, _eos(backbone)) for row in out.tolist()]


def test_the_capsule_changes_the_text_and_never_stays_attached():
    """A capsule changes what is generated; its hooks are gone afterwards, also when generate fails."""
    bb = tiny("tiny-llama")
    cap = random_capsule(bb)
    plain = generate(bb, PROMPTS, max_new_tokens=N)
    with_cap = generate(bb, PROMPTS, capsule=cap, max_new_tokens=N)
    assert [g.token_ids for g in plain] != [g.token_ids for g in with_cap]
    assert _count_hooks(bb.model) == hooks_at_load(bb)
    with pytest.raises(Exception):
        generate(bb, PROMPTS, capsule=cap, max_new_tokens=N, do_sample=True, temperature=-1.0)
    assert _count_hooks(bb.model) == hooks_at_load(bb)
    sampled = []
    for _ in range(2):   # sampling goes through to transformers, seeded by torch's generator
        torch.manual_seed(0)
        sampled.append(generate(bb, PROMPTS[0], capsule=cap, max_new_tokens=N, do_sample=True, top_k=50).token_ids)
    assert sampled[0] == sampled[1]


def test_a_long_prompt_is_cut_with_room_for_the_new_tokens():
    """Decoder-only: the prompt keeps its end (and BOS) and leaves max_new_tokens free under the limit."""
    bb = tiny("tiny-llama")
    cap = random_capsule(bb)
    long = " ".join(["word"] * (bb.max_length + 50))
    g = generate(bb, long, capsule=cap, max_new_tokens=8)
    n = len(bb.tokenizer(long)["input_ids"])
    assert g.truncated and g.dropped_tokens == n - (bb.max_length - 1 - 8)
    assert len(g.token_ids) <= 8


@pytest.mark.parametrize("call, message", [
    (lambda bb, cap: generate(bb, [], capsule=cap), "nothing to generate from"),
    (lambda bb, cap: generate(bb, ["ok", "  "], capsule=cap), "every prompt must be non-empty text, got '  '"),
    (lambda bb, cap: generate(bb, "ok", capsule=cap, max_new_tokens=0), "max_new_tokens=0 is out of range"),
    (lambda bb, cap: generate(bb, "ok", capsule=cap, input_ids=[1]), "input_ids: set by capt.generate"),
    (lambda bb, cap: generate(bb, "ok", capsule=cap, num_beams=2), "{'num_beams': 2}: a decoder-only backbone"),
    (lambda bb, cap: generate(bb, "ok", capsule=capt.Capsule(capt.CapsuleConfig(), 3, 32)),
     "this capsule is for a backbone with 3 layers x d=32; 'tiny-llama' has 4 layers x d=32"),
])
def test_bad_input_is_refused_with_a_clear_message(call, message):
    bb = tiny("tiny-llama")
    with pytest.raises(capt.CaptError, match=re.escape(message)):
        call(bb, random_capsule(bb))
    assert _count_hooks(bb.model) == hooks_at_load(bb)


def test_t5_returns_several_sequences_per_prompt_in_prompt_order():
    bb = tiny("tiny-t5")
    cap = random_capsule(bb)
    got = generate(bb, PROMPTS, capsule=cap, max_new_tokens=N, num_beams=2, num_return_sequences=2)
    assert len(got) == 4
    best = generate(bb, PROMPTS, capsule=cap, max_new_tokens=N, num_beams=2)
    assert [g.token_ids for g in got[::2]] == [g.token_ids for g in best]

