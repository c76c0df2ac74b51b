"""``dflash-jax bench`` end to end on tiny random models: table, JSON, plots, greedy check, simulated acceptance."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_oracle import tiny_drafter_config

from dflash_jax import frontend
from dflash_jax.cli import main
from dflash_jax.decoding.api import pad_prompts
from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop
from dflash_jax.decoding.proposers import NoProposer
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import init_drafter, save_drafter
from dflash_jax.models.target import load_target
from dflash_jax.perf import bench, peers

WORDS = [f"w{i}" for i in range(80)]


@pytest.fixture(scope="module")
def setup(hf_dense, tmp_path_factory):
    """Paths of a tiny target, a random block-4 drafter, a word-level tokenizer and a 2-prompt JSONL file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash_jax.train.tokenizer import EOS, MASK, save_hf

    _, target_dir = hf_dense
    root = tmp_path_factory.mktemp("bench")
    target = load_target(target_dir, dtype=jnp.float32, progress=False)
    cfg = tiny_drafter_config(target.cfg)
    save_drafter(root / "drafter", init_drafter(cfg, dtype=jnp.float32))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([EOS, MASK, "[UNK]", *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    save_hf(tok, root / "tok")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [" ".join(WORDS[i:i + n])]}) for i, n in ((3, 9), (20, 5))))
    return dict(model=target_dir, drafter=root / "drafter", tok=root / "tok", prompts=prompts, root=root)


def _argv(s, out, *extra):
    return ["bench", "--workload", "mbpp", "--prompts", str(s["prompts"]), "--num-prompts", "2",
            "--max-new-tokens", "16", "--model", str(s["model"]), "--draft-model", str(s["drafter"]),
            "--tokenizer", str(s["tok"]), "--out", str(out), "--quiet", "--ignore-eos", "--repeats", "1", *extra]


@pytest.mark.slow
def test_bench_end_to_end(setup, capsys):
    out = setup["root"] / "out"
    assert main(_argv(setup, out, "--methods", "ar,dflash:4,mtp:3")) == 0
    stdout, stderr = capsys.readouterr()
    assert "skipped mtp:3" in stderr and "no MTP head" in stderr  # the tiny target has no mtp.* weights
    assert "dflash:4" in stdout and "greedy check: every method's text equals ar's" in stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["machine"]["backend"] == "cpu" and report["machine"]["jax"]
    assert report["settings"]["encoding"] == "raw text" and report["settings"]["chat_template"] == "auto"
    ar, df = report["results"]
    assert (ar["method"], df["method"]) == ("ar", "dflash:4")
    for r in (ar, df):
        assert r["matches_ar"] and r["rows"] == 2 and r["tokens"] == 32 and r["first_run_s"] > 0
        assert r["repeats"] == 1 and r["compile_s"] >= 0 and r["speedup_spread"]["median"] == r["speedup"]
        assert set(r["step_ms"]) == {"draft", "verify", "commit"} and r["profiled_steps"] > 0
        assert sum(r["tau_hist"].values()) == r["steps"] and abs(sum(r["accept_frac"].values()) - 1) < 1e-3
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0 and ar["steps"] == 30 and ar["ceiling"] == 1.0
    assert df["ceiling"] > 0
    assert list(df["tau_hist"]) == ["1", "2", "3", "4"]
    for png in report["plots"]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulated_acceptance_fixes_tau(setup, capsys):
    out = setup["root"] / "sim"
    assert main(_argv(setup, out, "--methods", "dflash:4", "--simulate-acceptance", "2", "--no-plots",
                       "--profile-batches", "0")) == 0
    report = json.loads((out / "bench.json").read_text())
    _, df = report["results"]
    # 2 of 3 drafts accepted every step: 15 tokens after the first in 5 steps of 3.
    assert df["simulated"] and df["tau"] == 3.0 and df["tau_hist"] == {"1": 0, "2": 0, "3": 10, "4": 0}
    assert df["workload"] == "prompts.jsonl"  # --prompts' rows are labelled by the file, not by --workload
    assert df["matches_ar"] and "every method's text equals ar's" in capsys.readouterr().out


@pytest.mark.parametrize("text, match", [
    ("ar,eagle:3", "cannot parse 'eagle:3'"), ("mtp:16", "1..15"), ("dflash:1", ">= 2"), ("mtp:x", "cannot parse"),
    ("dflash:8,dflash:8", "listed twice"),
])
def test_method_errors(text, match):
    with pytest.raises(ValueError, match=match):
        bench.parse_methods(text)


def test_methods_parse():
    got = bench.parse_methods("mtp:3,dflash:16,ar")
    assert [(m.name, m.block) for m in got] == [("ar", 1), ("mtp:3", 4), ("dflash:16", 16)]
    got = bench.parse_methods("dflash:auto,hf:ar,zlab:16")
    assert got == [frontend.AR, bench.AUTO, peers.Peer("hf", 1), peers.Peer("zlab", 16)]
    with pytest.raises(ValueError, match="listed twice"):
        bench.parse_methods("dflash:auto,dflash:auto")


def _row(method, **kw):
    spread = dict(median=1.0, min=1.0, max=1.0, ci=[1.0, 1.0])
    return dict(dict(workload="w", concurrency=1, method=method, tau=1.0, tokens_per_s=10.0, speedup_spread=spread,
                     ceiling=None, e2e_speedup=1.0, loop_step_ms=1.0, floor_x=None, compile_s=0.0, matches_ar=True,
                     mismatched_rows=0, step_ms=dict(draft=0.0, verify=1.0, commit=0.1)), **kw)


def test_plots_name_each_method_as_asked(tmp_path):
    """tau.png's series are the methods' families, each point named as asked (dflash2:16, not "DFlash block B");
    a tree sits at its verify width N + 1."""
    rows = [_row(name, kind=kind, block=block, tree=tree, tau=tau) for name, kind, block, tree, tau in (
        ("ar", "ar", 1, None, 1.0), ("dflash:4", "dflash", 4, None, 2.0), ("dflash:16", "dflash", 16, None, 2.9),
        ("dflash2:16", "dflash", 16, None, 6.0), ("ddtree:63", "dflash", 16, 63, 4.4), ("mtp:3", "mtp", 4, None, 2.2))]
    assert bench._series(rows, "tau") == {
        "dflash": [(4, 2.0, "dflash:4"), (16, 2.9, "dflash:16")], "dflash2": [(16, 6.0, "dflash2:16")],
        "ddtree": [(64, 4.4, "ddtree:63")], "mtp": [(4, 2.2, "mtp:3")]}
    pytest.importorskip("matplotlib")
    assert bench.plot(rows, tmp_path) == ["tau.png", "tokens_per_s.png"]


def test_table_marks_the_auto_block_and_reports_a_peer_whose_text_differs():
    table = bench.format_table([_row("ar"), _row("dflash:8", auto=True),
                                _row("hf:ar", peer=True, step_ms=None),
                                _row("zlab:16", peer=True, step_ms=None, matches_ar=False, mismatched_rows=2)])
    lines = table.splitlines()
    assert "dflash:8 *" in lines[3] and lines[3].endswith("yes")
    assert "hf:ar" in lines[4] and lines[4].count("n/a") >= 3 and lines[4].endswith("yes")
    assert "zlab:16" in lines[5] and lines[5].endswith("NO (2 rows)")
    assert "--block-size auto chose" in lines[6] and "transformers' generate / z-lab's dflash_generate" in lines[7]


@pytest.mark.slow
def test_bench_auto_and_peers_end_to_end(setup, capsys):
    """dflash:auto resolved per concurrency (its reason printed, its row marked), and the peers timed beside the
    loop on the same checkpoint, their texts compared with ar's in the table and bench.json."""
    pytest.importorskip("dflash", reason="z-lab's package: pip install --no-deps dflash==0.1.0")
    out = setup["root"] / "auto"
    assert main(_argv(setup, out, "--methods", "dflash:auto,hf:ar,zlab:4", "--concurrency", "2", "--no-plots",
                      "--profile-batches", "0")) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("block size auto: ") == 1 and "mbpp c=2: block size auto: " in stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["methods"] == ["ar", "dflash:auto", "hf:ar", "zlab:4"]
    rows = {r["method"]: r for r in report["results"]}
    (auto,) = [r for r in rows.values() if r["auto"]]
    assert auto["block_choice"]["block"] == auto["block"] and auto["block_choice"]["batch"] == 2
    for peer in ("hf:ar", "zlab:4"):
        assert rows[peer]["peer"] and rows[peer]["tokens"] == 2 * 16 and isinstance(rows[peer]["matches_ar"], bool)
    assert rows["hf:ar"]["matches_ar"]  # transformers' greedy decoding of the checkpoint is plain decoding's
    line = next(x for x in stdout.splitlines() if " zlab:4 " in x)
    assert line.endswith("yes") == rows["zlab:4"]["matches_ar"]


def test_missing_dataset_says_how_to_provide_it(tmp_path, capsys):
    """bench's side of workloads.load_turns' error (tests/decoding/test_workloads.py checks the loader)."""
    assert main(["bench", "--workload", "gsm8k", "--prompts", str(tmp_path / "absent.jsonl"), "--out",
                 str(tmp_path / "out"), "--quiet"]) == 2
    assert "workload gsm8k: no prompts" in capsys.readouterr().err


def test_batches_cycle_prompts_into_whole_batches():
    assert bench._batches(3, 1) == [[0], [1], [2]]
    assert bench._batches(3, 2) == [[0, 1], [2, 0]]
    assert bench._batches(2, 4) == [[0, 1, 0, 1]]


class FakeDevice:
    """An asynchronous device on a mock clock: calls queue work, waiting on a result runs the queue.

    A method whose program ran last is warm; a run after another method's costs ``cold`` seconds more
    (its weights evicted from the caches), as interleaving does on a real machine.
    """

    def __init__(self, cold: float = 0.0):
        self.now, self.queued, self.last, self.cold = 0.0, 0.0, None, cold

    def clock(self) -> float:
        return self.now

    def submit(self, name: str, seconds: float):
        self.queued += seconds + (self.cold if self.last not in (None, name) else 0.0)
        self.last = name
        return Pending(self)


class Pending:
    def __init__(self, device):
        self.device, self.lengths, self.tau = device, [9], [1.0]

    def block_until_ready(self):  # what jax.block_until_ready calls on a leaf that is not an array
        self.device.now += self.device.queued
        self.device.queued = 0.0
        return self


class FakeLoop:
    """``init`` (prefill; the first call also compiles) and ``decode`` of known cost on a FakeDevice."""

    def __init__(self, device, name, prefill, decode, compile_s):
        self.device, self.name, self.cost, self.compile_s, self.calls = device, name, (prefill, decode), compile_s, 0

    def init(self, params, tokens, lengths, rng):
        self.calls += 1
        return self.device.submit(self.name, self.cost[0] + (self.compile_s if self.calls == 1 else 0.0))

    def decode(self, params, state):  # (output, final state), as SpeculativeLoop.decode returns
        return self.device.submit(self.name, self.cost[1]), state


def _fake_runs(device, costs):
    loops = {n: FakeLoop(device, n, *c) for n, c in costs.items()}
    return {n: lambda b, clock, loop=loop: bench.timed_run(loop, None, None, None, 0, clock) for n, loop in
            loops.items()}


def test_measure_excludes_compile_and_warm_up_and_waits_before_the_clock():
    device = FakeDevice()
    device.submit("earlier", 50.0)  # work queued before (e.g. an unwaited warm-up) lands in the first call alone
    timing = bench.measure(_fake_runs(device, {"a": (0.25, 2.0, 100.0), "b": (0.5, 1.0, 30.0)}), 3, 4,
                           clock=device.clock)
    assert timing["a"].prefill_s == [0.75] * 4 and timing["a"].decode_s == [6.0] * 4
    assert timing["b"].prefill_s == [1.5] * 4 and timing["b"].decode_s == [3.0] * 4
    assert timing["a"].compile_s == 150.0 and timing["b"].compile_s == 30.0
    assert len(timing["a"].outputs) == 3  # the last repeat's output per batch


def test_identical_work_reads_exactly_one_even_when_interleaving_evicts_caches():
    device = FakeDevice(cold=0.4)  # every switch of method costs the next run 0.4 s
    costs = {"dflash": (0.1, 1.0, 5.0), "ar": (0.1, 1.0, 5.0)}
    timing = bench.measure(_fake_runs(device, costs), 2, 3, clock=device.clock)
    ratio = bench.speedups(timing["dflash"], timing["ar"], 9, 9, 1)
    assert ratio["decode"] == {"median": 1.0, "min": 1.0, "max": 1.0, "ci": [1.0, 1.0]}
    assert ratio["e2e"]["median"] == 1.0
    assert timing["dflash"].decode_s == [2.0] * 3  # warm: no cold-cache penalty in any timed run


def test_identical_work_is_timed_through_one_compiled_program(hf_dense, monkeypatch):
    """compare(ar) against plain decoding (the CLI's --block-size 1): every run, warm-up and timed, of
    both 'methods' goes through one loop object (one set of compiled programs, compiled once), and
    the figures are medians over the repeats with their spread."""
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    loops, real = [], bench.timed_run
    monkeypatch.setattr(bench, "timed_run", lambda loop, *a, **k: (loops.append(loop), real(loop, *a, **k))[1])
    before = SpeculativeLoop.decode._cache_size()
    c = bench.compare(target, NoProposer(), (), frontend.AR, [[3, 4, 5]], max_new_tokens=4, sampling=SamplingConfig(),
                      stop_ids=(), seed=0, repeats=3, drafter_cfg=None, dtype="float32")
    # per method a first + a warm run, then one timed run per repeat; an untimed run precedes a timed one
    # where the previous run was the other method's (order A B | B A | A B: 2 + 1 + 1 untimed runs)
    assert len(loops) == 2 * 2 + 2 * 3 + 4
    assert len({id(loop) for loop in loops}) == 1 and SpeculativeLoop.decode._cache_size() - before <= 1
    assert c["same_tokens"] and c["tokens"] == c["baseline_tokens"] == 4 and c["ceiling"] == 1.0
    assert c["repeats"] == 3 and set(c["decode_speedup"]) == {"median", "min", "max", "ci"}
    assert "speed-up" in bench.format_comparison(c) and c["load_average"] is not None


def test_goals_compare_the_step_with_its_floor_and_the_draft_scaling():
    def row(method, floor_x, draft, draft_floor=None):
        return dict(workload="w", concurrency=1, method=method, floor_x=floor_x, loop_step_ms=2.0 * (floor_x or 1),
                    floor_ms=2.0, step_ms=dict(draft=draft, verify=1.0, commit=1.0), draft_floor_ms=draft_floor)
    text = bench.format_goals([row("ar", 1.5, 0.0), row("dflash:4", 1.1, 2.0, 1.0), row("dflash:16", 1.6, 3.0, 1.2),
                               row("mtp:3", None, 1.0), row("mtp:15", None, 4.0)])
    lines = text.splitlines()
    assert len(lines) == 4
    assert "DFlash block-16 step / its floor = 1.60x (3.20 ms / 2.00 ms); goal <= 1.3 NOT met" in lines[0]
    assert "plain-decoding step / its floor = 1.50x" in lines[1] and lines[1].endswith("met")
    assert "block 16 / block 4 = 1.50x (3.00 ms / 2.00 ms; its matmuls alone: 1.20x)" in lines[2]
    assert lines[2].endswith("NOT met")
    assert "15 steps / 3 steps = 4.00x" in lines[3] and lines[3].endswith("goal >= 3.0 met")
    assert bench.format_goals([row("ar", 1.5, 0.0)]).count("\n") == 0  # only the goals whose methods ran
    # a floor whose own ratio is above the goal is said
    text = bench.format_goals([row("dflash:4", 1.1, 2.0, 1.0), row("dflash:16", 1.2, 4.0, 2.0)])
    assert "(4.00 ms / 2.00 ms; its matmuls alone: 2.00x, above the goal on this machine); goal <= 1.3 NOT met" in text


def test_a_busy_machine_is_said(monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (9.5, 5.0, 2.0))
    assert "busy (load average 9.5 on 2 cores)" in bench.busy_note()
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (2.2, 5.0, 2.0))
    assert bench.busy_note() is None


@pytest.mark.slow
def test_random_config_benches_models_made_from_configs_alone(tmp_path, capsys):
    target_cfg, drafter_cfg = frontend.ASSETS / "target" / "config.json", frontend.ASSETS / "drafter" / "config.json"
    out = tmp_path / "r"
    assert main(["bench", "--random-config", f"{target_cfg},{drafter_cfg}", "--methods", "ar,dflash:4",
                 "--simulate-acceptance", "3", "--max-new-tokens", "9", "--num-prompts", "1", "--random-prompt-len",
                 "20", "--repeats", "1", "--profile-batches", "0", "--no-plots", "--quiet", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["models"]["random_weights"] and report["models"]["tokenizer"] is None
    (ar, dflash) = report["results"]
    assert ar["workload"] == "random" and ar["prompt_bucket"] == 32 and dflash["method"] == "dflash:4"
    assert dflash["tau"] == pytest.approx(4.0, abs=0.5) and dflash["matches_ar"]  # 3 drafts accepted per step
    assert ar["floor_ms"] > 0 and ar["loop_step_ms"] > 0
    assert "greedy check: every method's text equals ar's" in capsys.readouterr().out


@pytest.mark.parametrize("extra, match", [
    (["--model", "x"], "--random-config builds the models and prompts itself: drop --model"),
    (["--methods", "ar,dflash:4"], "DFlash methods need a drafter config"),
    (["--random-prompt-len", "0"], "--random-prompt-len must be >= 1"),
])
def test_random_config_errors(tmp_path, capsys, extra, match):
    argv = ["bench", "--random-config", str(frontend.ASSETS / "target" / "config.json"), "--out", str(tmp_path),
            "--quiet", *extra]
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_profile_times_each_phase_warm(monkeypatch):
    """The per-phase split excludes the phases' first (compiling) run and counts the loop's steps."""
    runs = []

    def phases(loop, params, state, clock):
        runs.append(state.left)
        return np.asarray([1.0, 2.0, 0.5]) + (100.0 if len(runs) == 1 else 0.0)  # the first run compiles

    class StepLoop:
        def init(self, params, tokens, lengths, rng):
            return SimpleNamespace(finish=np.array([0]), left=3)

        def step(self, params, s):
            return SimpleNamespace(finish=np.array([0 if s.left > 1 else 1]), left=s.left - 1)

    monkeypatch.setattr(bench, "timed_phases", phases)
    secs = bench.profile(StepLoop(), None, None, None, 0)
    assert secs.shape == (3, 3) and secs.sum(0).tolist() == [3.0, 6.0, 1.5]
    assert runs == [3, 3, 2, 1]  # compile on the first state, then one timed run per state the loop steps through


@pytest.fixture(scope="module")
def tiny_pair():
    """A random-weight hybrid target (width 32, 3 GDN + 1 attention layers) and a one-layer drafter."""
    from dflash_jax.perf import regime, synthetic

    target = synthetic.random_target(regime._hybrid(32, 4, 64, (2, 1, 16), (1, 2, 16)), dtype=jnp.float32)
    return target, synthetic.random_drafter(regime._drafter(32, 4, (2, 1, 16), 64), target)


@pytest.fixture(scope="module")
def tiny_dflash(tiny_pair):
    """(loop, params, tokens, lengths): DFlash block 4 on two prompts, as the bench builds it."""
    target, drafter = tiny_pair
    spec = SpecConfig(block_size=4, max_new_tokens=8, stop_ids=())
    loop, params = bench.method_loop(target, *frontend.proposer_for(frontend.Method("dflash", 4), target, drafter),
                                     spec)
    return (loop, params, *pad_prompts([[5, 6, 7], [8, 9]], 8, vocab_size=target.cfg.vocab_size))


def test_timed_phases_update_in_place_and_leave_the_state_usable(tiny_dflash):
    """Each phase donates what it replaces (its compiled program aliases those inputs to its outputs, as
    the fused step's does), so no phase copies a cache; the state handed in survives and steps as before."""
    loop, params, tokens, lengths = tiny_dflash
    s = loop.init(params, tokens, lengths, 0)
    secs = bench.timed_phases(loop, params, s)
    assert secs.shape == (3,) and np.isfinite(secs).all()
    assert (bench._phases(loop, params, s, 0, time.perf_counter) > 0).all()  # each phase's single run is timed
    rest = dataclasses.replace(s, cache=None, proposer=None)
    d = bench._draft(loop, params, jax.tree.map(jnp.copy, s.proposer), rest, jnp.int32(0))
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(s.cache))
    compiled = bench._check.lower(loop, params, s.cache, rest, d, jnp.int32(0)).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes
    after = loop.step(params, s)  # s was not consumed by the timed phases
    fused = loop.step(params, loop.init(params, tokens, lengths, 0))
    assert np.array_equal(np.asarray(after.out), np.asarray(fused.out))


def _matmuls_in_and_out_of_loops(hlo: str) -> tuple[int, int]:
    """(dots and convolutions reachable from a while body, the others) in a compiled module's text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if head := re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line):
            current = head.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)

    def reach(c, seen):
        if c not in seen:
            seen.add(c)
            for line in comps.get(c, []):
                for group in re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=(\{[^}]*\}|%[\w.\-]+)",
                                        line):
                    for callee in re.findall(r"%([\w.\-]+)", group):
                        reach(callee, seen)
        return seen

    inside = set()
    for body in re.findall(r"body=%([\w.\-]+)", hlo):
        reach(body, inside)
    everywhere = reach(re.search(r"^ENTRY %([\w.\-]+)", hlo, re.M).group(1), set())
    count = lambda cs: sum(len(re.findall(r"= \S+ (?:dot|convolution)\(", line)) for c in cs for line in comps[c])
    return count(inside), count(everywhere - inside)


def test_repeated_phases_keep_their_work_in_the_loop(tiny_dflash):
    """A phase's repeats compute what one run does, and XLA hoists none of their matmuls out of the loop
    (without the optimization barrier it moves most of verify's, which read only unchanged inputs)."""
    loop, params, tokens, lengths = tiny_dflash
    s = loop.init(params, tokens, lengths, 0)
    rest = dataclasses.replace(s, cache=None, proposer=None)
    copy = lambda: jax.tree.map(jnp.copy, s)
    once, thrice = (bench._draft(loop, params, copy().proposer, rest, jnp.int32(n)) for n in (0, 2))
    np.testing.assert_array_equal(np.asarray(once.tokens), np.asarray(thrice.tokens))
    v_once, v_thrice = (bench._check(loop, params, copy().cache, rest, once, jnp.int32(n)) for n in (0, 2))
    np.testing.assert_allclose(np.asarray(v_once.out.logits), np.asarray(v_thrice.out.logits), rtol=1e-5, atol=1e-5)
    programs = {"draft": bench._draft.lower(loop, params, s.proposer, rest, jnp.int32(2)),
                "check": bench._check.lower(loop, params, s.cache, rest, once, jnp.int32(2)),
                "settle": bench._settle.lower(loop, params, rest, once, v_once, jnp.int32(2))}
    counts = {k: _matmuls_in_and_out_of_loops(p.compile().as_text()) for k, p in programs.items()}
    assert counts["draft"][0] == counts["draft"][1] > 0, counts  # one run before the loop, one in its body
    assert counts["check"][0] == counts["check"][1] > 0, counts
    assert counts["settle"][0] > 0 == counts["settle"][1], counts  # all of settle's runs are in the loop


def test_timed_phases_is_the_cost_of_one_more_repeat(monkeypatch):
    """What a call costs whatever it computes cancels: (1 + 7 runs - 1 run) / 7."""
    def phases(loop, params, state, extra, clock):
        return np.asarray([0.3, 0.3, 0.3]) + (1 + extra) * np.asarray([1.0, 2.0, 0.5])  # 0.3 s a call

    monkeypatch.setattr(bench, "_phases", phases)
    np.testing.assert_allclose(bench.timed_phases(None, None, None, repeats=8), [1.0, 2.0, 0.5])


def test_spread():
    assert bench.spread([1.0, 3.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "ci": [1.0, 3.0]}


def test_median_interval_is_the_binomial_order_statistics():
    # n = 15: P(Binomial(15, 1/2) <= 3) = 576 / 2**15 = 0.018 <= 0.025 < P(<= 4) = 0.059: ranks 4 and 12
    assert bench.median_interval(list(range(1, 16))) == (4, 12)
    assert bench.median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0]) == (1.0, 8.0)  # n = 8: only [min, max]
    assert bench.median_interval(list(range(1, 10))) == (2, 8)  # n = 9: P(<= 1) = 10 / 512 = 0.0195


def test_bench_writes_json_before_plotting_and_notes_missing_matplotlib(setup, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = setup["root"] / "noplot"
    assert main(_argv(setup, out, "--methods", "ar", "--profile-batches", "0")) == 0
    err = capsys.readouterr().err
    assert "no plots (matplotlib is not installed" in err and "Traceback" not in err
    assert json.loads((out / "bench.json").read_text())["plots"] == []


def test_prompts_naming_a_directory_and_unwritable_out(tmp_path, capsys):
    assert main(["bench", "--workload", "mbpp", "--prompts", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    assert "is a directory, not a JSONL file" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["bench", "--out", str(tmp_path / "file" / "sub"), "--quiet"]) == 2
    assert f"--out {tmp_path / 'file' / 'sub'}: not writable" in capsys.readouterr().err


@pytest.mark.slow
def test_regime_fixed_tau_replays_plain_decoding_at_the_set_acceptance(tiny_pair):
    """regime.fixed_tau builds its loops with bench.method_loop / with_oracle: every block's greedy text is
    plain decoding's, and each step accepts min(tau, block) - 1 drafts (tau = committed per step, the last
    step cut by max_new)."""
    from dflash_jax.perf import regime

    target, drafter = tiny_pair
    r = regime.fixed_tau(target, drafter, blocks=(2, 4), tau=3, prompt_len=8, max_new=13, repeats=1)
    assert [b["block"] for b in r["blocks"]] == [2, 4]
    assert all(b["same_tokens"] for b in r["blocks"])
    # block 2: 2 tokens per step, 12 after the first -> 6 steps; block 4: 3 per step -> 4 steps
    assert [round(b["tau"], 4) for b in r["blocks"]] == [2.0, 3.0]


def test_floor_context_is_the_real_prompts_not_the_bucket():
    """The floors' attention reads each row's prompt plus half the new tokens, not the padded bucket."""
    assert bench.mean_context([[1] * 188, [1] * 272], 128) == 294  # (188 + 272) / 2 + 64; the bucket is 512
