"""The prefix cache's exactness checks, shared by test_engine.py (the shipped pair, dflash:8, chunks of 16) and
test_prefix_cache.py (every method, chunks of 16 and 64): prompt hits (``check_prefix_hits``) and a conversation's
next turns resuming after the previous reply (``check_reply_hits``)."""

from __future__ import annotations

import threading

from dflash_jax import frontend
from dflash_jax.decoding import prefix
from dflash_jax.decoding.api import generate
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.serve.engine import Job

WAIT_S = 600
NEW = 16  # tokens per request: the longest prompt (48) + NEW fits a context of 64


def serve_one(engine, prompt, max_tokens, sampling=SamplingConfig(), seed=0):
    """(tokens, Finish) of one request served alone."""
    got, result, done = [], {}, threading.Event()

    def emit(tokens, finish):
        got.extend(tokens)
        if finish is not None:
            result["finish"] = finish
            done.set()

    engine.submit(Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, seed=seed, stop_ids=(0,), emit=emit))
    assert done.wait(WAIT_S), "the request never finished"
    return got, result["finish"]


def check_prefix_hits(engine, target, drafter, block: int, tree_budget: int | None = None) -> None:
    """A prompt resent resumes from the block boundary before its last token (one token prefilled: its first token
    reads the restored Gated DeltaNet state and conv window at once, which the shipped model forgets within a few
    tokens), a longer one from the same snapshot then a chunk: tokens and verify steps equal ``generate`` alone (a
    drafter context not restored drafts differently: more steps), and a seeded sampled hit equals it too (its
    sampled drafts read that context). Corrupting the restored GDN state, the target's K/V or the drafter's pages
    fails this (tried by hand). ``engine``: a fresh prefix cache's or a used one's (blocks of 16)."""
    tok = frontend.load_tokenizer(frontend.ASSETS / "target")
    text = "def running_mean(values, window):\n    \"\"\"The mean of each window of values.\"\"\"\n    out = []\n"
    tokens = frontend.encode(tok, text * 3)
    short, long = tokens[:33], tokens[:48]  # blocks of 16: snapshots at 16 and 32 (and 48 for the long one)
    before = engine.stats()["prefix_cache"]
    kw = dict(drafter=drafter, block_size=block, tree_budget=tree_budget, stop_ids=(0,))
    asks = [(short, 0), (short, 32), (long, 32), (long, 32)]  # (prompt, tokens the cache serves)
    for prompt, cached in asks:
        got, finish = serve_one(engine, prompt, NEW)
        alone = generate(target, [prompt], max_new_tokens=NEW, **kw)
        assert (got, finish.cached, finish.steps) == (alone.token_lists()[0], cached, int(alone.steps[0]))
    sampling = SamplingConfig(temperature=0.8)
    got, finish = serve_one(engine, short, NEW, sampling, 99)
    assert finish.cached == 32
    assert got == generate(target, [short], max_new_tokens=NEW, sampling=sampling, rng=99, **kw).token_lists()[0]
    after = engine.stats()["prefix_cache"]
    assert after["hits"] - before["hits"] == 4 and after["cached_tokens"] - before["cached_tokens"] == 128
    assert 0 < after["bytes"] <= after["capacity_bytes"]
    check_reply_hits(engine, target, drafter, block, tree_budget)


def check_reply_hits(engine, target, drafter, block: int, tree_budget: int | None = None) -> None:
    """A conversation of three turns, each resending the last prompt, the engine's reply and a one-token message: the
    second (greedy) and third (seeded, sampled) resume past the previous prompt's end, from the snapshot of the
    finished row (prompt and reply, at whatever length its target had processed, or before its last step when that
    ran past the reply's end), and prefill a token or a few: their first token reads the restored Gated DeltaNet
    state at once, the drafter its restored context. Tokens and verify steps equal ``generate`` alone. A method
    whose replies are not kept (``prefix.keeps_replies``: MTP) resumes from its prompts' snapshots instead,
    exactly too."""
    tok = frontend.load_tokenizer(frontend.ASSETS / "target")
    tokens = frontend.encode(tok, "class Ring:\n    def __init__(self, size):\n        self.items = [None] * size\n")
    kw = dict(drafter=drafter, block_size=block, tree_budget=tree_budget, stop_ids=(0,))
    replies = prefix.keeps_replies(engine.loop)
    prompt, reply = tokens[:17], 8
    first, _ = serve_one(engine, prompt, reply)
    for turn, sampling, seed, new in ((2, SamplingConfig(), 0, reply), (3, SamplingConfig(temperature=0.8), 7, NEW)):
        before, prompt = len(prompt), prompt + first + tokens[17 + turn:18 + turn]
        got, finish = serve_one(engine, prompt, new, sampling, seed)
        alone = generate(target, [prompt], max_new_tokens=new, sampling=sampling, rng=seed, **kw)
        assert (got, finish.steps) == (alone.token_lists()[0], int(alone.steps[0])), f"turn {turn}"
        assert finish.cached > before if replies else finish.cached < before, f"turn {turn}: {finish.cached} cached"
        first = got
