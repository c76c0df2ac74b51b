"""How the kernel tests run the Pallas kernels: compiled on a GPU, interpreted everywhere else.

JAX's own Pallas tests use one ``INTERPRET`` switch so that every case runs both ways; the kernel
tests here do the same. On a CPU the Pallas interpreter checks the kernels' numerics against the
jnp references; the first time the suite runs on a GPU, the very same cases run the compiled Triton
kernels (``MODE`` is the matching kernel mode for ``impl=`` and ``with_kernels``).
"""

import jax

INTERPRET = jax.default_backend() != "gpu"  # the Triton kernels compile for CUDA and ROCm GPUs only
MODE = "interpret" if INTERPRET else "pallas"
