"""Rank workers for tests/test_faults.py: the fault cases of docs/reliability.md that run on CPU with gloo.

Each spawn starts fresh processes (a gloo world over a new TCP store), runs one worker
function per rank and writes `rank{r}.json` after every case, so a case that hangs or crashes
still leaves the earlier cases' results and says which case it was. `spawn` kills every rank
when the spawn runs past its time limit: a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .helpers import free_port, leave

BF16 = torch.bfloat16
TOL = 2e-2  # the gloo tests' bf16 tolerance (relative max error over max |eager|)
# Long enough for a rank to wait at a barrier while its peers compile on a loaded 2-core
# machine, short enough that a lost peer shows up as an error well inside the spawn's limit.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("ARFUSION_FAULTS_GLOO_TIMEOUT", "180")))


# ------------------------------------------------------------------ spawning


def init_world(rank: int, world: int, port: int, timeout=COLLECTIVE_TIMEOUT) -> None:
    """A gloo world over its own TCP store (a new port is a new store)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)


def spawn(fn, world: int, out_dir: str, *args, timeout: float, ports: int = 1) -> str | None:
    """fn(rank, world, ports, recorder, *args) on `world` fresh processes, first in one gloo
    world. None when every rank returned; otherwise what went wrong (a rank raised or died:
    the others are terminated; past `timeout` seconds: every rank is killed)."""
    port_list = [free_port() for _ in range(ports)]
    context = mp.start_processes(_entry, args=(world, port_list, fn, out_dir, args), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, min(2.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join(10)
                return f"timed out after {timeout:.0f} s: every rank killed"
    except Exception as e:  # ProcessRaisedException / ProcessExitedException
        return f"{type(e).__name__}: {e}"[-4000:]
    return None


def _entry(rank, world, ports, fn, out_dir, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_world(rank, world, ports[0])
    try:
        fn(rank, world, ports, Recorder(out_dir, rank), *args)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise  # the spawn reports it
    # Every case has ended and its result is on disk. Under CI load, gloo's threads once aborted a
    # rank of the recreated-world spawn in the interpreter's teardown, after all its cases passed
    # (SIGABRT, 2026-12-06): leave as helpers' ranks do.
    leave()


class Recorder:
    """This rank's results, rewritten to `rank{r}.json` after every case."""

    def __init__(self, out_dir: str, rank: int):
        self.path = Path(out_dir, f"rank{rank}.json")
        self.results: dict = {}

    def record(self, name: str, result: dict) -> None:
        self.results[name] = result
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.path)

    def run(self, name: str, case) -> dict:
        """case() -> dict; an exception becomes {"ok": False, "error": ...} (a clear error is an
        allowed outcome of a fault; the tests say which cases may end in one)."""
        self.record(name, {"ok": False, "error": "started, never finished"})
        started = time.perf_counter()
        try:
            result = case()
        except Exception as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 2)
        self.record(name, result)
        return result


def load(out_dir, world: int) -> list[dict]:
    results = []
    for rank in range(world):
        path = Path(out_dir, f"rank{rank}.json")
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results


# ------------------------------------------------------------------ helpers


def options():
    import arfusion

    return arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))


def compare(actual, expected) -> dict:
    actual = list(actual) if isinstance(actual, (list, tuple)) else [actual]
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    problems, worst = [], 0.0
    if len(actual) != len(expected):
        problems.append(f"{len(actual)} outputs, eager has {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.shape != e.shape or a.dtype != e.dtype:
            problems.append(f"output {i}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}")
            continue
        err = ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
        if not err <= TOL:
            problems.append(f"output {i}: relative error {err:.2e} > {TOL:.0e}")
    return {"ok": not problems, "err": worst, "problems": problems}


def stats() -> dict:
    import arfusion

    s = arfusion.stats()
    return {k: s[k] for k in ("fused_sites", "by_pattern", "unfused_sites", "why_not_codes", "dispatch", "graphs")}


def counters() -> dict:
    c = torch._dynamo.utils.counters
    return {"fxgraph_cache_hit": c["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": c["inductor"]["fxgraph_cache_miss"],
            "fxgraph_cache_bypass": c["inductor"]["fxgraph_cache_bypass"],
            "autograd_cache_hit": c["aot_autograd"]["autograd_cache_hit"],
            "autograd_cache_miss": c["aot_autograd"]["autograd_cache_miss"],
            "graphs_compiled": c["stats"]["unique_graphs"]}


def fresh_counts() -> None:
    import arfusion

    torch._dynamo.utils.counters.clear()
    arfusion.reset_stats()


def compiled_vs_eager(model, inputs) -> dict:
    """A fresh compile with the pass (backend torch, no FX graph cache) against eager."""
    torch._dynamo.reset()
    fresh_counts()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        expected = model(*inputs)
        actual = torch.compile(model, options=options())(*inputs)
    return {**compare(actual, expected), "stats": stats()}


# ------------------------------------------------------------------ 1. FX graph cache hit in a fresh process


def cache_round(rank, world, ports, rec, cache_dir, name):
    """Compile a two-layer TP decoder (5 sites) with the pass and Inductor's FX graph cache on,
    in a cache directory shared by both spawns: the first spawn fills it, the second hits it.
    One directory per rank: with a shared one, the rank that compiles second hits the entry the
    other just wrote (seen under CI load), and the cold round would not be cold."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    from .models import TinyDecoder

    torch.manual_seed(0)
    model = TinyDecoder(64, layers=2)
    torch.manual_seed(100 + rank)
    x = torch.randn(1, 4, 64, dtype=BF16)

    def case():
        torch._dynamo.reset()
        fresh_counts()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=True):
            expected = model(x)
            actual = torch.compile(model, options=options())(x)
        return {**compare(actual, expected), "stats": stats(), "counters": counters()}

    rec.run(name, case)


def cache_warm_then_recreate(rank, world, ports, rec, cache_dir):
    cache_round(rank, world, ports, rec, cache_dir, "cache_warm")
    recreate_world(rank, world, ports, rec)


# ------------------------------------------------------------------ 2. process group destroyed and re-created


def recreate_world(rank, world, ports, rec):
    """Compile in world A, destroy it, init world B (new TCP store, same ranks), run again.

    `decoder` all-reduces on the default group (dynamo guards WORLD's identity: a new WORLD is a
    recompile); `block` holds the WORLD object of world A, which outlives its destruction, and
    dynamo guards only its group_name ("0", the same in world B), so the graph compiled in
    world A runs again and resolves "0" at run time."""
    from .models import RowParallelThenNorm, TinyDecoder

    torch.manual_seed(0)
    decoder = TinyDecoder(64, layers=2)
    block = RowParallelThenNorm(64, group=dist.group.WORLD)
    torch.manual_seed(200 + rank)
    x = torch.randn(1, 4, 64, dtype=BF16)
    y, r = torch.randn(4, 64, dtype=BF16), torch.randn(4, 64, dtype=BF16)
    torch._dynamo.reset()
    compiled_decoder = torch.compile(decoder, options=options())
    compiled_block = torch.compile(block, options=options())
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)

    def before():
        fresh_counts()
        with torch.no_grad(), no_cache:
            d = compare(compiled_decoder(x), decoder(x))
            b = compare(compiled_block(y, r), block(y, r))
        return {"ok": d["ok"] and b["ok"], "decoder": d, "block": b, "stats": stats(),
                "group_name": dist.group.WORLD.group_name}

    rec.run("recreate_world_a", before)
    old_world = dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()
    init_world(rank, world, ports[1])  # a new store on a new port

    def old_compiled_default_group():
        fresh_counts()
        with torch.no_grad(), no_cache:
            out = compare(compiled_decoder(x), decoder(x))
        return {**out, "stats": stats(), "counters": counters(), "group_name": dist.group.WORLD.group_name,
                "new_world_object": dist.group.WORLD is not old_world}

    def old_compiled_stale_group_object():
        fresh_counts()
        with torch.no_grad(), no_cache:
            actual = compiled_block(y, r)  # block.group is world A's WORLD, destroyed
            block.group = dist.group.WORLD
            expected = block(y, r)  # what the model means: the sum over the live world
            block.group = old_world
            try:  # eager with the stale object, for the record
                eager_stale = compare(block(y, r), expected)
            except Exception as e:
                eager_stale = {"error": f"{type(e).__name__}: {e}"[:500]}
        return {**compare(actual, expected), "stats": stats(), "counters": counters(),
                "eager_with_stale_group": eager_stale}

    def fresh_compile():
        block.group = dist.group.WORLD
        out = compiled_vs_eager(decoder, (x,))
        with torch.no_grad(), no_cache:
            out["block"] = compare(torch.compile(block, options=options())(y, r), block(y, r))
        out["ok"] = out["ok"] and out["block"]["ok"]
        out["stats"] = stats()
        return out

    rec.run("recreate_old_compiled_default_group", old_compiled_default_group)
    rec.run("recreate_old_compiled_stale_group_object", old_compiled_stale_group_object)
    rec.run("recreate_fresh_compile", fresh_compile)
    dist.barrier()


# ------------------------------------------------------------------ 3. DP x TP: TP subgroups, one idle


def dp_by_tp_then_repair(rank, world, ports, rec):
    dp_by_tp(rank, world, ports, rec)
    repaired_worlds(rank, world, ports, rec)


def dp_by_tp(rank, world, ports, rec):
    """World of 4, TP groups {0,1} and {2,3} (dist.new_group), the model on the rank's own."""
    from .models import RowParallelThenNorm

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = groups[rank // 2]
    torch.manual_seed(0)
    model = RowParallelThenNorm(64, group=tp)

    def inputs(tokens):
        torch.manual_seed(300 + rank)
        return torch.randn(tokens, 64, dtype=BF16), torch.randn(tokens, 64, dtype=BF16)

    # Only TP group {0, 1} runs the model; {2, 3} go straight to the final barrier and wait there.
    if rank < 2:
        rec.run("one_tp_group_active", lambda: {**compiled_vs_eager(model, inputs(5)),
                                                "group": tp.group_name, "group_size": tp.size()})
    else:
        rec.record("one_tp_group_active", {"ok": True, "idle": True})
    waited = time.perf_counter()
    dist.barrier()
    rec.results["one_tp_group_active"]["barrier_seconds"] = round(time.perf_counter() - waited, 2)
    # Both TP groups at once, different token counts (3 and 7).
    rec.run("both_tp_groups", lambda: {**compiled_vs_eager(model, inputs(3 if rank < 2 else 7)),
                                       "group": tp.group_name, "tokens": 3 if rank < 2 else 7})
    dist.barrier()


# ------------------------------------------------------------------ 2b. re-paired worlds: backend state by group name


def _fake_flashinfer(process):
    """The FlashInfer stand-in (tests/fake_flashinfer.py), run by the real op on CPU tensors; its
    workspace all-reduces over the group it was created for, as a real one (IPC buffers of that
    group's peers) does."""
    from arfusion import runtime
    from arfusion.backends import flashinfer as fi
    from arfusion.backends import get_backend

    from .fake_flashinfer import H200, install_fake_flashinfer

    calls = install_fake_flashinfer()
    fi.device_facts = lambda index: replace(H200, uuid=f"GPU-fake-{process}")
    runtime.device_index = lambda device: 0
    backend = get_backend("flashinfer")
    backend.capabilities = replace(backend.capabilities, device_types=frozenset({"cpu"}))
    backend.unavailable = lambda device: None
    return calls, backend


def _fused_op_vs_reference(process, backend_name):
    import arfusion.ops  # noqa: F401  (registers torch.ops.arfusion.*)
    from arfusion import reference
    from arfusion.core import Form

    torch.manual_seed(400 + process)
    x, res = torch.randn(8, 64, dtype=BF16), torch.randn(8, 64, dtype=BF16)
    w = (1 + 0.1 * torch.randn(64)).to(BF16)
    name = dist.group.WORLD.group_name
    got = torch.ops.arfusion.fused_allreduce_rmsnorm(
        x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=name, norm="rms", quant="none",
        quant_scale=None, emit_norm=True, backend=backend_name)
    want = reference.unfused(x, res, w, 1e-6, name, Form(residual=True, norm="rms"))
    return compare(got, want)


def repaired_worlds(process, world, ports, rec):
    """The 4 processes leave the 4-rank world and pair up as two worlds of 2 ({0,1}, {2,3}), then
    re-pair ({0,2}, {1,3}): every process's WORLD is "0" of size 2 both times, with a different
    peer. Compiled graphs (torch backend) resolve "0" when they run: they must reduce with the
    new peer. The FlashInfer backend looks its per-group state up by the group's name: the second
    pairing's "0" is another ProcessGroup, so it must get a workspace of its own, negotiated with
    the new peer (test_faults checks one is created and the result is the new pair's sum)."""
    from .models import RowParallelThenNorm

    dist.barrier()
    dist.destroy_process_group()
    init_world(process % 2, 2, ports[1 + process // 2])  # {0,1} and {2,3}
    torch.manual_seed(0)
    block = RowParallelThenNorm(64)  # default group
    torch.manual_seed(500 + process)
    y, r = torch.randn(4, 64, dtype=BF16), torch.randn(4, 64, dtype=BF16)
    compiled_block = torch.compile(block, options=options())
    # Two copies holding the first pairing's WORLD object, stale in the second pairing: one
    # compiled with the pass, one without it (what Inductor alone does with the baked name).
    stale = RowParallelThenNorm(64, group=dist.group.WORLD)
    stale.load_state_dict(block.state_dict())
    stale_plain = RowParallelThenNorm(64, group=dist.group.WORLD)
    stale_plain.load_state_dict(block.state_dict())
    compiled_stale, compiled_stale_plain = torch.compile(stale, options=options()), torch.compile(stale_plain)
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)

    def torch_path():
        fresh_counts()
        with torch.no_grad(), no_cache:
            return {**compare(compiled_block(y, r), block(y, r)), "stats": stats(), "counters": counters()}

    calls, backend = _fake_flashinfer(process)

    def flashinfer_path(peer):
        fresh_counts()
        before = len(calls["create"])
        out = _fused_op_vs_reference(process, "flashinfer")
        return {**out, "stats": stats(), "workspaces_created": len(calls["create"]) - before,
                "peer": peer}

    def stale_group_object(first):
        fresh_counts()
        with torch.no_grad(), no_cache:
            fused, plain = compiled_stale(y, r), compiled_stale_plain(y, r)
            if first:
                return {**compare(fused, stale(y, r)), "stats": stats()}
            eager_stale = stale(y, r)  # eager on the destroyed group object
            stale.group = dist.group.WORLD
            eager_live = stale(y, r)
            stale.group = stale_plain.group
        out = compare(fused, eager_live)
        as_inductor = compare(fused, plain)
        return {**out, "ok": out["ok"] and as_inductor["ok"], "same_as_without_the_pass": as_inductor,
                "eager_with_stale_group_vs_live": compare(eager_stale, eager_live), "stats": stats(),
                "counters": counters()}

    rec.run("pairs_first_torch", torch_path)
    rec.run("pairs_first_stale_group_object", lambda: stale_group_object(True))
    rec.run("pairs_first_flashinfer_stand_in", lambda: flashinfer_path(process ^ 1))
    dist.barrier()
    dist.destroy_process_group()
    init_world(process // 2, 2, ports[3 + process % 2])  # {0,2} and {1,3}
    rec.run("pairs_second_torch_old_compiled", torch_path)
    rec.run("pairs_second_stale_group_object", lambda: stale_group_object(False))
    rec.run("pairs_second_flashinfer_stand_in", lambda: flashinfer_path(process ^ 2))
    dist.barrier()
    backend.close()


# ------------------------------------------------------------------ 4. world size 6


def world_of_6(rank, world, ports, rec):
    from .models import RowParallelThenNorm

    torch.manual_seed(0)
    model = RowParallelThenNorm(64)
    torch.manual_seed(600 + rank)
    inputs = (torch.randn(1, 4, 64, dtype=BF16), torch.randn(1, 4, 64, dtype=BF16))
    rec.run("world_6", lambda: {**compiled_vs_eager(model, inputs), "world_size": dist.get_world_size()})
