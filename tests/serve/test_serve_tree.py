"""``dflash-jax serve`` with draft trees (``--method ddtree:N``, or ``--speculative-config`` method "ddtree"): the
flags read as the tree they name, the slots' cache holding a tree's N + 1 verify tokens, and a real server on the
shipped pair driven by the ``openai`` client: greedy text under continuous batching (more requests than slots,
a tree per row) equal to plain decoding, a seeded sampled request among others equal to the library's
``generate`` with the same tree and seed, and SGLang's acceptance figures counting a tree's N drafts a step. A
DFlash2 drafter's tree is served alike (grown from its candidate selector)."""

import argparse
import json
import random
import threading

import numpy as np
import openai
import pytest
from serve_fixtures import running

from dflash_jax import frontend
from dflash_jax.cli import build_parser
from dflash_jax.cli import generate as cli_generate
from dflash_jax.cli import serve as cli_serve
from dflash_jax.decoding.api import bucket_for, generate
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.serve.engine import Engine, spec_for

BUDGET = 8  # the served tree's nodes: 9 verify tokens per row, depth <= 15 (the shipped drafter's block 16)
SLOTS = 3
MAX_LEN = 64  # one prefill bucket for every prompt below (<= 16 tokens: bucket 16) and 48 new tokens at most
TIMEOUT_S = 300  # a bound on any one request, far above its need
TEXTS = ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef list_files(",
         "def is_prime(n):\n", "x = [i * i for i in", "def add(a, b):\n    return")


def _args(*flags):
    return build_parser().parse_args(["serve", *flags])


def test_the_flags_name_a_tree_and_the_slots_hold_its_verify():
    """``--method ddtree:N`` and ``--speculative-config`` method "ddtree" (num_speculative_tokens: the budget, the
    drafter's block) read as the same tree before any weight loads; neither is re-chosen by ``--block-size auto``;
    the engine's cache holds max(block, N + 1) verify tokens past the context. Bad combinations name the flag."""
    drafter = str(frontend.ASSETS / "drafter")
    _, _, method, max_len, _ = cli_serve._settings(_args("--method", "ddtree:32", "--max-model-len", "64"))
    assert (method.name, method.block, method.tree, max_len) == ("ddtree:32", 16, 32, 64)
    config = json.dumps({"method": "ddtree", "model": drafter, "num_speculative_tokens": 32})
    args = _args("--speculative-config", config)
    assert cli_serve._settings(args)[2] == method
    generate_args = build_parser().parse_args(["generate", "x", "--speculative-config", config])
    assert cli_generate.check_request(generate_args).method == method  # generate reads it alike
    assert not cli_generate.auto_block(args) and not cli_generate.auto_block(_args("--method", "ddtree:32"))
    assert cli_generate.auto_block(_args())  # the chain's default stays auto
    spec = spec_for(16, 64, 32)
    assert (spec.tree_budget, spec.width, spec.capacity) == (32, 33, bucket_for(64) + 64 + 33)
    assert spec_for(16, 64, 4).capacity == spec_for(16, 64).capacity == Engine.capacity(64, 16)  # 5 < the block
    for flags, needle in ((["--speculative-config", json.dumps({"method": "ddtree", "model": drafter})],
                           '"ddtree" needs "num_speculative_tokens"'),
                          (["--speculative-config", config, "--block-size", "8"], "leave out --block-size"),
                          (["--method", "ddtree:8", "--block-size", "8"], "leave out --block-size"),
                          (["--method", "ddtree:8:32"], "exceed the drafter's block size"),
                          (["--method", "ddtree:0"], "--method")):
        with pytest.raises(ValueError, match=needle):
            cli_serve._settings(_args(*flags))
    with pytest.raises(ValueError, match="needs a drafter"):  # a user's target has no default drafter
        cli_generate.method_from_flags(argparse.Namespace(block_size=None, draft_model=None, method="ddtree:8"),
                                       None, None)


def test_serve_builds_the_engine_of_the_tree_it_was_given(monkeypatch):
    """``build`` (what ``dflash-jax serve`` runs) makes the engine's loop draft the named tree, with its verify
    width in the slots' cache and its N drafts in the figures, and does not re-choose it by cost. (Its serving is
    the slow tests' below; here the engine's first compilation is left out.)"""
    from dflash_jax.perf import step_cost

    def no_choice(*a, **k):
        raise AssertionError("--block-size auto re-chose a given tree")

    monkeypatch.setattr(step_cost, "choose", no_choice)
    monkeypatch.setattr(Engine, "_empty_state", lambda self: None)
    served, _ = cli_serve.build(_args("--method", "ddtree:40", "--max-model-len", "64", "--max-num-seqs", "32",
                                      "--no-warmup"))
    engine = served.engine
    assert (engine.loop.spec.tree_budget, engine.loop.spec.block_size, engine.slots) == (40, 16, 32)
    assert engine.loop.spec.capacity == Engine.capacity(64, 41) and engine.drafts_per_step == 40
    assert served.speculative and not engine.loop.proposer.cfg.dflash2  # the shipped target's default drafter
    config = json.dumps({"method": "ddtree", "model": str(frontend.ASSETS / "dflash2"), "num_speculative_tokens": 24})
    served, _ = cli_serve.build(_args("--speculative-config", config, "--max-model-len", "64", "--no-warmup"))
    loop = served.engine.loop  # a DFlash2 drafter: its tree grown from the selector (DFlashProposer.tree)
    assert loop.proposer.cfg.dflash2 and (loop.spec.tree_budget, loop.spec.block_size) == (24, 16)


@pytest.fixture(scope="module")
def server():
    with running("--method", f"ddtree:{BUDGET}", "--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_LEN),
                 "--no-warmup", "--served-model-name", "tree") as r:
        yield r


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def target():
    return frontend.load_models(frontend.ASSETS / "target", None, [frontend.AR], dtype=np.float32, progress=False)[0]


def _together(calls):
    """Runs the ``calls`` (no-argument functions) at once, each in its own thread; their results in order."""
    out = [None] * len(calls)

    def run(i):
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert all(r is not None for r in out), "a request did not finish"
    return out


@pytest.mark.slow
def test_greedy_trees_under_continuous_batching_equal_plain_decoding(server, client, target):
    """Six requests of different lengths on three slots (queued, slots reused, rows at different positions):
    each completion is plain decoding's text, and its meta_info counts the tree's N drafts per verify step."""
    tok = server.served.tokenizer
    prompts = [frontend.encode(tok, t) for t in TEXTS]
    rng = random.Random(0)
    budgets = [rng.randint(8, MAX_LEN - 16) for _ in prompts]
    asks = [lambda p=p, n=n: client.completions.create(
        model="tree", prompt=p, max_tokens=n, temperature=0, extra_body={"ignore_eos": True, "return_meta_info": True})
        for p, n in zip(prompts, budgets, strict=True)]
    served = _together(asks)
    plain = generate(target, prompts, max_new_tokens=max(budgets), stop_ids=()).token_lists()
    accepted = 0
    for out, want, n in zip(served, plain, budgets, strict=True):
        assert out.choices[0].text == tok.decode(want[:n])
        assert out.usage.completion_tokens == n and out.choices[0].finish_reason == "length"
        meta = out.model_extra["meta_info"]
        steps = meta["spec_verify_ct"]
        assert meta["spec_draft_token_num"] == BUDGET * steps  # a tree verifies N drafts a step, not block - 1
        # every token after the first is a draft or a step's bonus; the last step may be cut inside its drafts
        assert n - 1 <= steps + meta["spec_accept_token_num"] <= n
        accepted += meta["spec_accept_token_num"]
    assert accepted > 0  # the trees' drafts were accepted
    stats = server.engine.stats()
    assert (stats["tree_budget"], stats["drafts_per_step"], stats["block_size"]) == (BUDGET, BUDGET, 16)


@pytest.mark.slow
def test_seeded_sampling_through_the_server_equals_generate_with_the_same_tree(server, client, target):
    """A sampled request (temperature 0.8, top-k 40, seed 1234) served beside greedy and other sampled requests
    emits the library's ``generate`` tokens with the same tree budget and seed; another seed differs."""
    tok = server.served.tokenizer
    prompt = frontend.encode(tok, TEXTS[1])
    kw = dict(model="tree", max_tokens=40, temperature=0.8, extra_body={"ignore_eos": True, "top_k": 40})
    other_prompts = [frontend.encode(tok, t) for t in TEXTS[2:5]]
    others = [lambda p=p, s=s: client.completions.create(
        model="tree", prompt=p, max_tokens=30, temperature=1.0 if s % 2 else 0, seed=s,
        extra_body={"ignore_eos": True}) for s, p in enumerate(other_prompts)]
    crowded = _together([*others, lambda: client.completions.create(prompt=prompt, seed=1234, **kw)])[-1]
    engine = server.engine
    want = generate(target, [prompt], drafter=(engine.loop.proposer, engine.params[1]), block_size=16,
                    max_new_tokens=40, sampling=SamplingConfig(temperature=0.8, top_k=40), stop_ids=(), rng=1234,
                    tree_budget=BUDGET).token_lists()[0]
    assert crowded.choices[0].text == tok.decode(want)
    assert client.completions.create(prompt=prompt, seed=4321, **kw).choices[0].text != crowded.choices[0].text
