"""Helpers shared by the tests: gloo ranks in spawned processes, and comparisons.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(fn, world: int, *args, fresh: bool = False) -> None:
    """fn(rank, *args) on `world` gloo ranks. Worlds of 2 are kept for the next test of this
    pytest process (a world's start, imports and first compile cost about 14 s of CPU); `fresh`
    (or ARFUSION_TEST_FRESH_RANKS=1) spawns new processes, for a test that leaves them changed."""
    if world == 2 and not fresh and os.environ.get(FRESH_ENV) != "1":
        _kept_world(world).run(fn, args)
    else:
        mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def collect_from_ranks(fn, world: int, tmp_dir) -> list[dict]:
    """fn(rank) -> a JSON-able dict, run on `world` gloo ranks (run_workers); the dicts by rank."""
    path = str(tmp_dir / "out")
    run_workers(_write_result, world, fn, path)
    return [json.load(open(f"{path}.{rank}")) for rank in range(world)]


def _write_result(rank, fn, path):
    result = fn(rank)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(result, f)


def _join(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def leave():
    if dist.is_initialized():
        dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's own teardown, where gloo's threads
    # sometimes abort the process ("terminate called without an active exception", SIGABRT after
    # a passing test; pytorch/pytorch#179291, as in tests/gpu/soak.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world, port, fn, args):
    _join(rank, world, port)
    try:
        fn(rank, *args)
    except BaseException:
        dist.destroy_process_group()
        raise  # mp.spawn reports it
    leave()


FRESH_ENV = "ARFUSION_TEST_FRESH_RANKS"
_KEPT: dict[int, "_KeptWorld"] = {}


def _kept_world(world: int) -> "_KeptWorld":
    if world not in _KEPT or not _KEPT[world].alive():
        _KEPT[world] = _KeptWorld(world)
    return _KEPT[world]


class _KeptWorld:
    """`world` gloo ranks in processes that run one job after another. Each job starts with
    Dynamo's caches and arfusion's stats reset and ends with the environment and Inductor's pass
    slot as they were. A job that fails, hangs or kills a rank ends the world (its ranks are
    killed, as mp.spawn does); the next job starts a new one."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(rank, world, port, self.jobs[rank], self.results))
                      for rank in range(world)]
        for proc in self.procs:
            proc.start()
        atexit.register(self.close)

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn, args, timeout: float = 900) -> None:
        for jobs in self.jobs:
            jobs.put((fn, args))
        deadline, waiting = time.monotonic() + timeout, set(range(len(self.procs)))
        while waiting:
            try:
                rank, error = self.results.get(timeout=2)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"gloo ranks: {'exit codes ' + str(dead) if dead else 'timed out'} "
                                       f"while running {getattr(fn, '__name__', fn)}")
                continue
            waiting.discard(rank)
            if error is not None:
                self.close()
                raise RuntimeError(f"rank {rank} failed in {getattr(fn, '__name__', fn)}:\n{error}")

    def close(self) -> None:
        for jobs, proc in zip(self.jobs, self.procs):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _serve(rank, world, port, jobs, results):
    import arfusion
    from torch._inductor import config as inductor_config

    _join(rank, world, port)
    while (job := jobs.get()) is not None:
        fn, args = job
        env, slot = dict(os.environ), inductor_config.post_grad_custom_post_pass
        error = None
        try:
            torch._dynamo.reset()
            arfusion.reset_stats()
            fn(rank, *args)
            dist.barrier()  # both ranks done before either takes the next job
        except BaseException:
            error = traceback.format_exc()
        finally:
            os.environ.clear()
            os.environ.update(env)
            inductor_config.post_grad_custom_post_pass = slot
        results.put((rank, error))
    leave()


def stderr_for_a_user(stderr: str) -> list[str]:
    """The non-blank lines of a run's stderr, torchrun's own lines aside (torch/distributed/run.py:
    its notice that it sets OMP_NUM_THREADS=1 for its workers, which the README calls harmless)."""
    return [line for line in stderr.splitlines() if line.strip() and "torch/distributed/run.py:" not in line]


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
