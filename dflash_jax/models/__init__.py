"""The networks, as functional Flax NNX modules whose parameter paths are their Hugging Face keys.

RoPE, the shared layers (linear, MLP, RMSNorm, gated attention, Gated DeltaNet), the caches, the
Qwen3.5 target (prefill / verify / commit), the DFlash drafter (KV injection) and the MXFP4 weight
storage. Built on ``config`` and ``io``, calling ``kernels``; used by ``decoding``.
"""
