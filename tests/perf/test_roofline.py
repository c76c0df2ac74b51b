"""The roofline: FLOPs and bytes checked against hand counts and the models' own parameter trees,
the ceiling in its two limits, and the measured floor: its program, and the ceiling from it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.target import Qwen35ForCausalLM
from dflash_jax.perf import roofline

# All-attention, tied: small enough to count by hand.
HAND = TargetConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, layer_types=("full_attention",) * 2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                    tie_word_embeddings=True)
HYBRID = TargetConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4,
                      layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=96)
MOE = TargetConfig(**{**HYBRID.__dict__, "intermediate_size": 0, "num_experts": 8, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})
DRAFT = DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=160, vocab_size=512, block_size=16, mask_token_id=1,
                      target_layer_ids=(0, 2), num_target_layers=4)


def test_hand_counted_decode_step():
    # Per layer: q (with gate) 64x128, k 64x32, v 64x32, o 64x64, MLP 3x64x128 = 40960 weights; tied head 64x256.
    weights = 2 * 40960 + 64 * 256
    attn = 2 * 2 * 2 * (1 * 2 * 32 * 11)  # 2 layers x (QK, PV) x 2 FLOPs: 1 query, 2 heads of 32, 11 keys
    cost = roofline.step_cost(HAND, None, block=1, context=10, dtype=jnp.float32)
    assert cost.flops == 2 * weights + attn
    kv = 2 * 2 * (11 + 1) * 32 * 4  # 2 layers x K,V x (11 rows read + 1 written) x 32 x f32
    assert cost.bytes == 4 * weights + kv + 64 * 4 + 256 * 4  # + embedding row, f32 logits


def _matmul_weights(state) -> int:
    """Entries of every 2-D [out, in] weight of an abstract NNX state (norms, conv, decay params excluded)."""
    return sum(math.prod(v.shape) for _, v in nnx.to_flat_state(state) if len(v.shape) == 2)


def test_flops_match_the_parameter_trees():
    """At context 0 a step's matmul FLOPs are 2 x rows x the 2-D weights of the real modules."""
    graph = nnx.eval_shape(lambda: Qwen35ForCausalLM(HYBRID, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    params = nnx.state(graph, nnx.Param)
    embed = HYBRID.vocab_size * HYBRID.hidden_size  # gathered, not multiplied (the head is untied)
    T, B = 5, 3
    attn = 2 * 2 * B * T * 4 * 16 * T  # one attention layer, T keys
    got = roofline.target_cost(HYBRID, tokens=T, batch=B, dtype=jnp.float32).flops
    assert got == 2 * B * T * (_matmul_weights(params) - embed) + attn

    drafter = nnx.state(nnx.eval_shape(lambda: DFlashDrafter(DRAFT, dtype=jnp.float32, rngs=nnx.Rngs(0))), nnx.Param)
    Bk = 8
    context_kv = 2 * 2 * B * Bk * 64 * (2 * 2 * 16)  # 2 layers' K and V projections (2 heads of 16) of the context
    head = 2 * B * (Bk - 1) * 64 * 512
    attn = 2 * 2 * 2 * B * Bk * 4 * 16 * Bk
    got = roofline.drafter_cost(DRAFT, HYBRID, block=Bk, batch=B, dtype=jnp.float32).flops
    assert got == 2 * B * Bk * _matmul_weights(drafter) + context_kv + head + attn


def test_flops_near_xla_count():
    """XLA's own FLOP count of the compiled full-sequence forward agrees with the analytic count."""
    from dflash_jax.models.target import forward, init_target

    target = init_target(HAND)
    tokens = jnp.zeros((2, 16), jnp.int32)
    compiled = jax.jit(lambda p, t: forward(target.graphdef, p, t).logits).lower(target.params, tokens).compile()
    xla = compiled.cost_analysis()["flops"]
    ours = roofline.target_cost(HAND, tokens=16, batch=2, dtype=jnp.float32).flops
    assert 0.9 < xla / ours < 1.25, (xla, ours)  # XLA also counts norms, softmax and elementwise ops


def test_moe_reads_only_the_experts_it_picks():
    one = roofline.target_cost(MOE, tokens=1, dtype=jnp.bfloat16)
    many = roofline.target_cost(MOE, tokens=16, batch=32, dtype=jnp.bfloat16)
    expert = 3 * 64 * 32 * 2  # gate/up/down of one expert, bf16
    assert roofline._distinct_experts(1, 8, 2) == pytest.approx(2)
    assert roofline._distinct_experts(512, 8, 2) == pytest.approx(8)
    # 4 layers each read 6 more experts at 512 tokens than at 1 (plus activations, K/V and logits)
    assert many.bytes - one.bytes > 4 * 6 * expert


def test_ceiling_limits():
    """Bandwidth-bound: the ceiling is tau x byte ratio; compute-bound: tau x FLOP ratio."""
    kw = dict(block=16, batch=1, context=100, dtype=jnp.bfloat16)
    plain = roofline.step_cost(HYBRID, None, block=1, batch=1, context=100, dtype=jnp.bfloat16)
    spec = roofline.step_cost(HYBRID, DRAFT, **kw)
    bandwidth_bound = roofline.Machine(matmul_flops_per_s=1e30, bytes_per_s=1e9)
    compute_bound = roofline.Machine(matmul_flops_per_s=1e9, bytes_per_s=1e30)
    assert roofline.ceiling(bandwidth_bound, HYBRID, DRAFT, tau=6, **kw) == pytest.approx(
        6 * plain.bytes / spec.bytes)
    assert roofline.ceiling(compute_bound, HYBRID, DRAFT, tau=6, **kw) == pytest.approx(6 * plain.flops / spec.flops)
    # compute-bound, a 16-token step costs more than 16 one-token steps' FLOPs (the drafter is extra)
    assert roofline.ceiling(compute_bound, HYBRID, DRAFT, tau=16, **kw) < 1
    assert roofline.tokens_per_second(bandwidth_bound, HYBRID, None, block=1, tau=1) == pytest.approx(
        1e9 / roofline.step_cost(HYBRID, None, block=1).bytes)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block 4 needs a drafter"):
        roofline.step_cost(HYBRID, None, block=4)
    with pytest.raises(ValueError, match="batch=0"):
        roofline.step_cost(HYBRID, DRAFT, block=4, batch=0)


def test_program_runs_exactly_the_listed_matmuls():
    """XLA's own FLOP count of one run of the floor's program is the matmuls' FLOPs (plus the chain's
    adds), each weight is its own buffer of the real size, and every output is returned."""
    cost = roofline.step_cost(HYBRID, DRAFT, block=4, context=10, dtype=jnp.float32)
    assert sum(m.flops for m in cost.matmuls) == cost.flops
    fn, (inputs, weights) = roofline.matmul_program(cost.matmuls, "float32")
    lead = lambda m: (m.count,) if m.count > 1 else ()
    assert [w.shape for w in weights] == [(*lead(m), m.d_out, m.d_in) for m in cost.matmuls]
    assert len({id(w) for w in weights}) == len(weights)
    compiled = jax.jit(fn, static_argnums=0).lower(1, inputs, weights).compile()
    adds = sum(x.size for x in inputs)
    assert compiled.cost_analysis()["flops"] == pytest.approx(cost.flops + adds, rel=0.01)
    outs = jax.jit(fn)(3, inputs, weights)
    assert [o.shape for o in outs] == [(*lead(m), m.rows, m.d_out) for m in cost.matmuls]
    assert all(bool(jnp.allclose(o, 1.0)) for o in outs)  # ones @ (1 / d_in): no overflow along the chain


def test_floor_timer_and_ceiling_are_sane():
    window = roofline.step_floor_timer(HYBRID, None, block=1, context=10, window_s=0.01)
    s = window()
    assert 0 < s < 10 and math.isfinite(s)
    c = roofline.measured_ceiling(HYBRID, DRAFT, block=4, tau=3.0, context=10)
    assert 0 < c and math.isfinite(c)


HAND_DRAFT = DrafterConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, intermediate_size=128, vocab_size=256, block_size=4, mask_token_id=1,
                           target_layer_ids=(0,), num_target_layers=2)


def test_step_matmuls_are_the_modules_shapes():
    """The floor's program at block 4, context 10, by hand: every module's own linear, in order, and
    attention's QK / PV per KV head (2 query heads of 32 share one KV head: 4 x 2 query rows)."""
    M = roofline.Matmul
    layer = [M(4, 64, 128), M(4, 64, 32), M(4, 64, 32),  # q (with gate), k, v
             M(8, 32, 14), M(8, 14, 32), M(4, 64, 64),  # QK over 14 keys, PV, o
             M(4, 64, 128), M(4, 64, 128), M(4, 128, 64)]  # gate, up, down
    target = 2 * layer + [M(4, 64, 256)]  # the tied head on 4 rows
    drafter = [M(4, 64, 64),  # fc over the one tap
               M(4, 64, 32), M(4, 64, 32),  # context K, V
               M(4, 64, 64), M(4, 64, 32), M(4, 64, 32),  # q, k, v
               M(8, 32, 14), M(8, 14, 32), M(4, 64, 64),
               M(4, 64, 128), M(4, 64, 128), M(4, 128, 64),
               M(3, 64, 256)]  # the target's head on the 3 draft rows
    assert roofline.step_cost(HAND, HAND_DRAFT, block=4, context=10).matmuls == tuple(target + drafter)
    # the draft phase: the drafter's pass and the head, without the commit's fc and context K/V
    assert roofline.draft_cost(HAND_DRAFT, HAND, block=4, context=10).matmuls == tuple(drafter[3:])


@pytest.fixture
def fake_timer(monkeypatch):
    """``install(seconds)``: every program's window takes ``seconds(matmuls)``; the ratios' cache is
    emptied on install and afterwards, so no fake figure outlives the test."""
    def clear():
        roofline.program_ratio.cache_clear()

    def install(seconds):
        monkeypatch.setattr(roofline, "_timer", lambda matmuls, dtype, window_s: lambda: seconds(matmuls))
        clear()

    yield install
    clear()


def test_measured_ceiling_on_hand_counted_flops(fake_timer):
    """What the CLI prints: tau x plain step floor / DFlash step floor. With a program timer that
    charges 1 ns per FLOP, that is tau x a ratio of hand-counted FLOPs."""
    fake_timer(lambda matmuls: sum(m.flops for m in matmuls) * 1e-9)
    plain = 2 * (2 * 40960 + 64 * 256) + 2 * 2 * 2 * (2 * 32 * 11)  # test_hand_counted_decode_step at context 10
    # verify of 4 tokens: 2 layers' weights + attention over 14 keys + tied head on 4 rows
    verify = 2 * 4 * 2 * 40960 + 2 * 2 * 2 * (4 * 2 * 32 * 14) + 2 * 4 * 64 * 256
    # drafter: fc over the tap, context K/V, q/k/v, o, attention over 14 keys, MLP, the target's head on 3 rows
    draft = (2 * 4 * 64 * 64 + 2 * 4 * 64 * 64 + 2 * 4 * 64 * 128 + 2 * 4 * 64 * 64 + 2 * 2 * (4 * 2 * 32 * 14)
             + 2 * 4 * 64 * 384 + 2 * 3 * 64 * 256)
    assert roofline.step_cost(HAND, HAND_DRAFT, block=4, context=10).flops == verify + draft
    assert roofline.step_floor_timer(HAND, None, block=1, context=10)() == pytest.approx(plain * 1e-9)
    got = roofline.measured_ceiling(HAND, HAND_DRAFT, block=4, tau=3.0, context=10)
    assert got == pytest.approx(3.0 * plain / (verify + draft))  # 0.63x: the block costs 4.7 plain steps
    # a timing of the block's program below the one-token program's (a busy machine) cannot make a block cheaper
    fake_timer(lambda matmuls: 1.0 / len(matmuls))
    assert roofline.measured_ceiling(HAND, HAND_DRAFT, block=4, tau=3.0, context=10) == pytest.approx(3.0)
