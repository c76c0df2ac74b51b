"""Two processes on localhost (CPU, gloo collectives) run one sharded generate: the same tokens as one device.

The test starts ``python tests/test_parallel_multihost.py PID PORT`` twice; each process has 2
simulated CPU devices, joins the run through ``cli.args.mesh_from_args`` (the CLI's flags:
``--coordinator-address``, ``--num-processes``, ``--process-id``, ``--data-parallel-size 2
--tensor-parallel-size 2``), decodes a batch on the 4-device mesh (rows split over the processes,
heads over each process's devices) and, on its own first device alone, the same batch unsharded.
Only process 0 prints: process 1's stdout stays empty, also of gloo's own log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import pytest

TIMEOUT = 480  # seconds for both processes: ~40 s on an idle 2-core machine, minutes when it is loaded


def worker(pid: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import jax.numpy as jnp

    from dflash_jax.cli import args as cli_args
    from dflash_jax.config import TargetConfig
    from dflash_jax.decoding.api import generate
    from dflash_jax.models.target import init_target

    args = argparse.Namespace(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=1,
                              distributed=False, coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                              process_id=pid)
    mesh = cli_args.mesh_from_args(args)  # jax.distributed first: nothing above may start a backend
    from test_parallel import DENSE  # (after: its import asks for the default backend, via pallas_mode)

    target = init_target(TargetConfig.from_hf(DENSE), dtype=jnp.float32)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]
    kw = dict(max_new_tokens=6, stop_ids=())
    sharded = generate(target, prompts, mesh=mesh, **kw).token_lists()  # every process takes part
    single = generate(target, prompts, **kw).token_lists() if pid == 0 else None  # one device, process 0 only
    print(json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                      "sharded": sharded, "single": single}), flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(pid), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for pid in (0, 1)]
    deadline, outs = time.monotonic() + TIMEOUT, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1][-1500:] for p in procs]
        pytest.fail(f"the two processes did not finish in {TIMEOUT} s (port {port}); stderr:\n" + "\n---\n".join(errs))
    for pid, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {pid} failed:\n{err[-3000:]}"
    assert outs[1][0].strip() == "", f"process 1 printed: {outs[1][0][:500]}"
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert (result["processes"], result["devices"]) == (2, 4)
    assert result["sharded"] == result["single"]
    assert all(len(row) == 6 for row in result["single"])


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]))
