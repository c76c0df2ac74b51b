"""The engine's prefix cache and chunked prefill for every method (ar, mtp, dflash, dflash2, ddtree) at chunks of 16
and 64 tokens, on the shipped pair: hits and chunk boundaries exact against ``generate`` alone
(``prefix_checks.check_prefix_hits``). The default run checks dflash:8 at 16 (test_engine.py); this matrix is slow."""

import numpy as np
import pytest
from prefix_checks import check_prefix_hits

from dflash_jax import frontend
from dflash_jax.decoding.loop import SpeculativeLoop
from dflash_jax.serve.engine import Engine, spec_for

MAX_LEN = 64


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("method", ["ar", "mtp:3", "dflash:8", "dflash2:8", "ddtree:8:8"])
def test_prefix_hits_and_chunks_are_exact_for_every_method(method, chunk):
    m = frontend.parse_method(method)
    drafts = frontend.ASSETS / ("dflash2" if m.dflash2 else "drafter")
    target, drafter = frontend.load_models(frontend.ASSETS / "target", drafts, [m], dtype=np.float32, progress=False)
    proposer, pparams = frontend.proposer_for(m, target, drafter)
    loop = SpeculativeLoop.of(target, proposer, spec_for(m.block, MAX_LEN, m.tree))
    engine = Engine(loop, (target.params, pparams), slots=2, max_model_len=MAX_LEN, max_queue=4,
                    prefix_cache_bytes=1 << 26, max_num_batched_tokens=chunk, prefix_block=16)
    engine.warmup()
    engine.start()
    try:
        check_prefix_hits(engine, target, None if m.block == 1 else (proposer, pparams), m.block, m.tree)
    finally:
        engine.close()
