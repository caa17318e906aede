"""Helpers shared by the tests: gloo ranks in spawned processes, and comparisons.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(fn, world: int, *args) -> None:
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def collect_from_ranks(fn, world: int, tmp_dir) -> list[dict]:
    """fn(rank) -> a JSON-able dict, run on `world` gloo ranks in one spawn; the dicts by rank."""
    path = str(tmp_dir / "out")
    run_workers(_write_result, world, fn, path)
    return [json.load(open(f"{path}.{rank}")) for rank in range(world)]


def _write_result(rank, fn, path):
    result = fn(rank)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(result, f)


def _worker(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's own teardown, where gloo's threads
    # sometimes abort the process ("terminate called without an active exception", SIGABRT after
    # a passing test; pytorch/pytorch#179291, as in tests/gpu/soak.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_close(actual, expected, dtype, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    err = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e}"


def compiled_vs_eager(module, inputs, dynamic=False, backend="torch"):
    import arfusion

    arfusion.reset_stats()
    torch._dynamo.reset()
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend))
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        expected = module(*inputs)
        actual = torch.compile(module, options=options, dynamic=dynamic)(*inputs)
    return actual, expected, arfusion.stats()
