"""FlashInfer backend logic on CPU, with a stand-in for flashinfer (tests/fake_flashinfer.py; no
GPU, no FlashInfer).

Covers: dispatch-table lookups at their boundaries, the tuned cache, every guard, the
crossover derivation of `arfusion tune`, and (in two gloo processes) the workspace lifecycle:
collective agreement, reuse, growth, failure on one rank, capture without a workspace, and
the arguments handed to FlashInfer (backend "trtllm" only, zero residual, Gemma bias, ...), and
torch's symmetric memory kept from NVLink multicast while FlashInfer allocates.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from arfusion import core, reference, runtime, tuning
from arfusion.backends import flashinfer as fi
from arfusion.backends import flashinfer_dispatch as dispatch
from arfusion.backends import flashinfer_kernel
from arfusion.backends.base import tables_changed
from arfusion.core import Call, Form
from arfusion.decisions import Why

from .fake_flashinfer import B200, H200, FlashInferDeprecation, install_fake_flashinfer, remove_fake_flashinfer
from .helpers import leave

MiB = dispatch.MiB
CUDA = torch.device("cuda", 0)
PLAIN = Form(residual=True, norm="rms")


@pytest.fixture
def backend(monkeypatch, tmp_path):
    """A fresh backend on a pretend H200, with no tuned cache and FlashInfer "installed"."""
    monkeypatch.setenv(dispatch.CACHE_ENV, str(tmp_path / "tuning.json"))
    monkeypatch.setattr(fi, "device_facts", lambda index: H200)
    install_fake_flashinfer()
    for cached in (fi._environment_problem, dispatch.limits_for, dispatch._read_cache):
        cached.cache_clear()
    yield fi.FlashInferBackend()
    remove_fake_flashinfer()
    for cached in (fi._environment_problem, dispatch.limits_for, dispatch._read_cache):
        cached.cache_clear()


def call(tokens, hidden=4096, world=4, dtype=torch.bfloat16, weight_dtype=None, site=PLAIN, device=CUDA,
         oneshot=None):
    return Call(form=site, tokens=tokens, hidden=hidden, dtype=dtype, weight_dtype=weight_dtype or dtype,
                world_size=world, device=device, group_name="tp", oneshot=oneshot)


# ----------------------------------------------------------------- table lookups


@pytest.mark.parametrize("world,hidden,last_fused", [(2, 4096, 4096), (4, 4096, 1024), (8, 4096, 64),
                                                     (4, 8192, 512), (2, 8192, 2048)])
def test_largest_fused_size_is_inclusive(backend, world, hidden, last_fused):
    assert backend.why_not(call(last_fused, hidden, world)) is None
    assert backend.why_not(call(last_fused + 1, hidden, world)).code is Why.SIZE_CAP


@pytest.mark.parametrize("world,hidden,last_oneshot", [(2, 4096, 4096), (4, 4096, 256), (8, 8192, 32)])
def test_oneshot_switch_is_inclusive(backend, world, hidden, last_oneshot):
    assert backend.use_oneshot(call(last_oneshot, hidden, world))
    assert not backend.use_oneshot(call(last_oneshot + 1, hidden, world))


def test_twoshot_never_chosen_for_tokens_up_to_world_size(backend, monkeypatch):
    no_oneshot = dispatch.Limits(64 * MiB, 0, "test")
    monkeypatch.setattr(backend, "limits", lambda c: no_oneshot)
    assert backend.use_oneshot(call(4, world=4)) and not backend.use_oneshot(call(5, world=4))
    # A forced two-shot (tuning, benchmarks) still runs one-shot where two-shot cannot.
    assert backend.use_oneshot(call(4, world=4, oneshot=False)) and not backend.use_oneshot(call(5, world=4, oneshot=False))
    assert backend.use_oneshot(call(4096, world=4, oneshot=True))


def test_both_16bit_dtypes_share_the_table_and_sm100_has_its_own(backend, monkeypatch):
    assert backend.why_not(call(256, dtype=torch.float16)) is None
    monkeypatch.setattr(fi, "device_facts", lambda index: fi.DeviceFacts((10, 0), "NVIDIA B200", "u"))
    fi._environment_problem.cache_clear()
    assert backend.why_not(call(4096, world=4)) is None  # 32 MiB on SM100 at world 4
    assert backend.why_not(call(4097, world=4)).code is Why.SIZE_CAP


def test_world_16_needs_a_tuned_entry(backend):
    assert backend.why_not(call(8, world=16)).code is Why.NO_TABLE
    assert backend.why_not(call(8, world=16), max_bytes_override=MiB) is None  # user's own cap


def test_user_cap_overrides_the_table_but_not_the_hard_limit(backend):
    assert backend.why_not(call(4096, world=4), max_bytes_override=32 * MiB) is None
    assert backend.why_not(call(2, world=2), max_bytes_override=0).code is Why.SIZE_CAP
    assert backend.why_not(call(8192, 8192, 2), max_bytes_override=1 << 40).code is Why.SIZE_CAP


def test_unknown_token_count_is_left_to_run_time(backend):
    assert backend.why_not(call(None)) is None


def test_tuned_cache_wins_and_changes_the_fingerprint(backend):
    before = backend.fingerprint()
    key = dispatch.tuned_key("NVIDIA H200", 4, 4096, torch.bfloat16)
    tuning.save_entry(key, {"max_fused_tokens": 128, "oneshot_max_tokens": 32}, dispatch.cache_path())
    dispatch.forget_cache()
    assert backend.why_not(call(128)) is None and backend.why_not(call(129)).code is Why.SIZE_CAP
    assert backend.use_oneshot(call(32)) and not backend.use_oneshot(call(33))
    assert backend.why_not(call(256, hidden=2048)) is None  # other hidden: seed table (1 MiB)
    assert backend.fingerprint() != before and dispatch.cache_hash()


def test_unreadable_or_foreign_cache_is_ignored(backend):
    dispatch.cache_path().write_text("{not json")
    dispatch.forget_cache()
    assert dispatch.tuned_entries() == {} and backend.why_not(call(256)) is None
    dispatch.cache_path().write_text(json.dumps({"version": 999, "entries": {"x": {}}}))
    dispatch.forget_cache()
    assert dispatch.tuned_entries() == {}


# ----------------------------------------------------------------- guards


@pytest.mark.parametrize("change,code", [
    (dict(weight_dtype=torch.float32), Why.WEIGHT_DTYPE),
    (dict(hidden=4100), Why.SHAPE),
    (dict(world=3), Why.WORLD_SIZE),
    (dict(world=6), Why.WORLD_SIZE),
    (dict(world=1), Why.WORLD_SIZE),
    (dict(dtype=torch.float32), Why.DTYPE),
    (dict(device=torch.device("cpu")), Why.DEVICE),
])
def test_guards_decline_with_a_reason(backend, change, code):
    assert backend.why_not(call(8, **change)).code is code


def test_flashinfer_missing(backend):
    remove_fake_flashinfer()
    assert backend.why_not(call(8)).code is Why.NO_BACKEND


def test_unsupported_sm(backend, monkeypatch):
    monkeypatch.setattr(fi, "device_facts", lambda index: fi.DeviceFacts((8, 0), "NVIDIA A100", "u"))
    assert backend.why_not(call(8)).code is Why.NO_BACKEND


def test_rocm_build_is_not_ours(backend, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert backend.why_not(call(8)).code is Why.NO_BACKEND


def test_capture_without_workspace_declines(backend, monkeypatch):
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert backend.prepare(call(8)).code is Why.RUNTIME


def test_long_lived_buffers_are_made_on_a_helper_thread():
    # cudagraph trees route every allocation of the warming-up *thread* to the graph's pool, so
    # workspaces are made on another thread; its result and its errors come back to the caller.
    import threading

    from arfusion.runtime import on_helper_thread, outside_graph_pools

    caller = threading.get_ident()
    assert on_helper_thread(threading.get_ident) != caller
    with pytest.raises(ValueError, match="from the helper"):
        on_helper_thread(lambda: (_ for _ in ()).throw(ValueError("from the helper")))
    assert outside_graph_pools(torch.device("cpu"), threading.get_ident) == caller  # nothing to avoid


def test_no_forbidden_flashinfer_backends_in_source():
    source = Path(fi.__file__).read_text()
    assert 'FI_BACKEND = "trtllm"' in source and "backend=FI_BACKEND" in source
    for forbidden in ('backend="auto"', 'backend="mnnvl"', "multimem", "cuMulticastCreate"):
        assert forbidden not in source


# ----------------------------------------------------------------- tune's crossover


def test_crossover_stops_at_the_first_loss():
    M = tuning.Measured
    rows = [M(1, 10, 5, None), M(2, 10, 5, None), M(8, 11, 6, 7), M(64, 15, 9, 8), M(128, 20, 14, 12),
            M(256, 30, 33, 31), M(512, 45, 60, 40)]  # two-shot wins again at 512: not re-enabled
    assert tuning.crossover(rows, world_size=4) == (8, 128)


def test_crossover_never_fuses_when_unfused_always_wins():
    rows = [tuning.Measured(t, 5, 6, 7) for t in (1, 8, 64)]
    assert tuning.crossover(rows, world_size=2)[1] == 0


def test_quantized_crossover_is_where_it_wins_from_there_on():
    M = tuning.Measured
    # exact path: fused one-shot up to 256 tokens, unfused above (max_fused 256)
    rows = [M(64, 20, 10, None, 30), M(256, 40, 25, None, 20), M(512, 60, 70, None, 50),
            M(1024, 100, 120, None, 110), M(2048, 180, 200, None, 120), M(4096, 340, 400, None, 200)]
    # wins at 256 and 512, loses at 1024, wins from 2048 on: only 2048 counts
    assert tuning.quantized_crossover(rows, oneshot_max=256, max_fused=256, world_size=2) == 2048
    assert tuning.quantized_crossover(rows[:3], 256, 256, 2) == 256
    never = [M(t, 10, 5, None, 50) for t in (64, 128)]
    assert tuning.quantized_crossover(never, 128, 128, 2) is None
    entry = {"max_fused_tokens": 256, "oneshot_max_tokens": 256, "quantized_min_tokens": {"fp8": 2048},
             "measured": [dict(tokens=r.tokens, unfused_us=r.unfused_us, oneshot_us=r.oneshot_us,
                               twoshot_us=r.twoshot_us, quantized_us=r.quantized_us) for r in rows]}
    text = tuning.format_rows(entry)
    assert "quantized fp8" in text.splitlines()[5] and "unfused" in text.splitlines()[4]
    assert "fp8 quantized all-reduce from 2048 tokens" in text


# ----------------------------------------------------------------- workspace lifecycle, 2 ranks


def _worker(rank, world, init_file, out_dir):
    calls = install_fake_flashinfer()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    fi.device_facts = lambda index: replace(H200, uuid=f"GPU-fake-{rank}")
    runtime.device_index = lambda device: 0
    import arfusion
    from arfusion.backends import get_backend

    backend = get_backend("flashinfer")
    dispatch.WORKSPACE_EXCHANGE_TIMEOUT_S = 3.0  # fail_create: rank 0 gives up on rank 1 quickly
    # Let the real op run this backend on CPU tensors.
    backend.capabilities = replace(backend.capabilities, device_types=frozenset({"cpu"}))
    backend.unavailable = lambda device: None
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "0"  # the process's own choice: to be left as it is
    results = {}

    def scenario(name, group):
        for key in ("create", "fusion"):
            calls[key].clear()
        calls["fail_build"] = name == "fail_build" and rank == 1
        calls["fail_create"] = name == "fail_create" and rank == 1
        # Rank 1's GPU without room for the workspace (the pre-check every rank agrees on).
        fi._free_device_bytes = (lambda device: 0) if name == "low_memory" and rank == 1 else (lambda device: None)
        arfusion.reset_stats()
        result = results[name] = {"errors": []}
        small = 1024 * 64 * 2  # a user cap of 1024 tokens at hidden 64: the first workspace's size

        def check(tokens, residual=True, norm="rms", max_bytes=small if name == "ok" else None, oneshot=None):
            torch.manual_seed(100 + rank + tokens)
            x = torch.randn(tokens, 64, dtype=torch.bfloat16)
            res = torch.randn(tokens, 64, dtype=torch.bfloat16) if residual else None
            w = (0.1 * torch.randn(64)).to(torch.bfloat16)
            if oneshot is None:
                got = torch.ops.arfusion.fused_allreduce_rmsnorm(
                    x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=group.group_name, norm=norm,
                    quant="none", quant_scale=None, emit_norm=True, backend="flashinfer", max_bytes=max_bytes)
            else:  # the kernel forced one way, as tuning and the benchmarks call it (no op around it)
                forced = Call.of_tensors(Form(residual=residual, norm=norm), x, w, 2, group.group_name,
                                         oneshot=oneshot)
                assert backend.why_not(forced, max_bytes) is None and backend.prepare(forced, max_bytes) is None
                got = backend.run(forced, x, res, w, 1e-6, None)
            want = reference.unfused(x, res, w, 1e-6, group.group_name, Form(residual=residual, norm=norm))
            for g, r in zip(got, want):
                if not torch.allclose(g.float(), r.float(), atol=0.05, rtol=0.02):
                    result["errors"].append(f"T={tokens}: max diff {(g.float() - r.float()).abs().max().item()}")

        check(8)
        if name == "ok":
            for shape in ((2, 5, 64), (40, 64)):  # the plain fast-path all-reduce, on the same workspace
                torch.manual_seed(7 + rank)
                x = torch.randn(*shape, dtype=torch.bfloat16)
                got = torch.ops.arfusion.all_reduce(x=x, group_name=group.group_name, backend="flashinfer")
                want = reference.all_reduce_sum(x, group.group_name)
                if got.shape != x.shape or not torch.equal(got, want):
                    result["errors"].append(f"plain {shape}: max diff {(got.float() - want.float()).abs().max()}")
            check(3, residual=False)  # zero residual, same workspace
            check(40, norm="gemma_rms")
            check(2, oneshot=False)  # two-shot needs tokens > world size: stays one-shot
            check(100, oneshot=False)  # two-shot
            check(4096, max_bytes=4096 * 64 * 2)  # outgrows the workspace: a second, larger one
            result["retired"] = len(backend._groups[group.group_name].retired)
        # What the backend now says to a call on this group (no collective: decided already).
        later = Call.of_tensors(PLAIN, torch.empty(8, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16),
                                2, group.group_name)
        declined = backend.prepare(later)
        result.update(creates=list(calls["create"]), fusion=list(calls["fusion"]),
                      multicast_env_after=os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
                      dispatch=arfusion.stats()["dispatch"], group=group.group_name,
                      failed=backend._groups.current(group.group_name).failed,
                      declined=declined and declined.code.value, declined_message=declined and declined.message)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        direct_before = calls["direct"]
        scenario("ok", dist.group.WORLD)
    results["ok"]["direct"] = calls["direct"] - direct_before
    results["ok"]["deprecations"] = [str(w.message) for w in caught if issubclass(w.category, FlashInferDeprecation)]
    results["unified"] = unified_scenario(calls, dist.group.WORLD.group_name, rank)
    results["quant"] = quant_scenario(calls, dist.group.WORLD.group_name, rank)
    results["bound"] = bound_scenario(calls, backend, dist.group.WORLD.group_name, rank)
    results["shared"] = shared_scenario(calls, backend, rank)
    results["empty"] = empty_scenario(calls, dist.group.WORLD.group_name, rank)
    # Fresh groups over the same ranks, each after close(): else they would share the world's
    # workspace (shared_scenario); so each negotiates one of its own.
    for name in ("fail_build", "fail_create", "low_memory"):
        backend.close()
        scenario(name, dist.new_group([0, 1]))
    backend.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    leave()


def shared_scenario(calls, backend, rank):
    """Two groups of the same ranks (transformers' expert-parallel and TP groups) share one
    workspace: the second group's calls make none, a call that outgrows it on either group grows
    the one they share, and close() destroys each workspace once."""
    backend.close()
    creates, errors = len(calls["create"]), []
    world, twin = dist.group.WORLD.group_name, dist.new_group([0, 1]).group_name

    def one(group_name, tokens, seed):
        torch.manual_seed(10 * seed + rank)
        x, res = torch.randn(2, tokens, 64, dtype=torch.bfloat16).unbind(0)
        w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
        got = torch.ops.arfusion.fused_allreduce_rmsnorm(
            x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=group_name, norm="rms",
            quant="none", quant_scale=None, emit_norm=True, backend="flashinfer", max_bytes=tokens * 64 * 2)
        want = reference.unfused(x, res, w, 1e-6, group_name, PLAIN)
        errors.extend(f"{group_name} T={tokens}" for g, r in zip(got, want)
                      if not torch.allclose(g.float(), r.float(), atol=0.05, rtol=0.02))
        plain = torch.ops.arfusion.all_reduce(x=x, group_name=group_name, backend="flashinfer")
        if not torch.equal(plain, reference.all_reduce_sum(x, group_name)):
            errors.append(f"plain {group_name} T={tokens}")
        return len(calls["create"]) - creates

    made = [one(world, 8, 0), one(twin, 8, 1), one(twin, 512, 2), one(world, 512, 3), one(world, 8, 4)]
    same = backend._groups.current(world) is backend._groups.current(twin)
    states = len(backend._groups.everything())
    workspaces = [backend._groups.current(world).workspace, *backend._groups.current(world).retired]
    backend.close()
    return {"errors": errors, "made_after_each": made, "same_state": same, "states": states,
            "destroyed": [ws.destroyed for ws in workspaces]}


def empty_scenario(calls, group_name, rank):
    """An empty batch at run time (a graph traced with a symbolic token count, called with none):
    the fused op, its MoE twin and the plain all-reduce give empty results without entering the
    kernel, whose grid is sized by the tokens (0 blocks do not launch), after a call that did."""
    import logging

    import arfusion

    arfusion.reset_stats()
    fusion, errors, lines = len(calls["fusion"]), [], []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("arfusion").addHandler(handler)
    logging.getLogger("arfusion").setLevel(logging.INFO)
    torch.manual_seed(5 + rank)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    try:
        for tokens in (4, 0):
            x, res = torch.randn(2, tokens, 64, dtype=torch.bfloat16).unbind(0)
            for form in (PLAIN, Form(residual=False, norm="rms", quant="fp8_dynamic", emit_norm=False)):
                got = torch.ops.arfusion.fused_allreduce_rmsnorm(
                    x=x, residual=res if form.residual else None, weight=w, eps=1e-6, eps_tensor=None,
                    group_name=group_name, norm="rms", quant=form.quant, quant_scale=None, emit_norm=form.emit_norm,
                    backend="flashinfer")
                want = reference.unfused(x, res if form.residual else None, w, 1e-6, group_name, form)
                errors += [f"{form.name} T={tokens}" for g, r in zip(got, want) if g.shape != r.shape or g.dtype != r.dtype]
            got = torch.ops.arfusion.moe_combine_allreduce_rmsnorm(
                rows=torch.randn(2 * tokens, 64, dtype=torch.bfloat16), scale=torch.rand(2 * tokens, 1, dtype=torch.bfloat16),
                index=torch.arange(2 * tokens), top_k=2, scale_first=True, residual=res, weight=w, eps=1e-6,
                eps_tensor=None, group_name=group_name, norm="rms", quant="none", quant_scale=None, emit_norm=True,
                backend="flashinfer")
            errors += [f"moe T={tokens}" for g in got if list(g.shape) != [tokens, 64]]
            plain = torch.ops.arfusion.all_reduce(x=x, group_name=group_name, backend="flashinfer")
            errors += [f"plain T={tokens}"] if not torch.equal(plain, reference.all_reduce_sum(x, group_name)) else []
    except Exception as e:  # the stand-in's kernel, as the real launcher, refuses 0 tokens
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        logging.getLogger("arfusion").removeHandler(handler)
    return {"errors": errors, "kernel_tokens": [f["tokens"] for f in calls["fusion"][fusion:]],
            "dispatch": arfusion.stats()["dispatch"],
            "logged": [line for line in lines if Why.ZERO_TOKENS.value in line or "zero tokens" in line]}


def unified_scenario(calls, group_name, rank):
    """A FlashInfer without `trtllm_allreduce_fusion`: the unified `allreduce_fusion` runs the
    kernel instead, with the same results (a fused site, then a plain all-reduce)."""
    comm = sys.modules["flashinfer.comm"]
    kernel = comm.trtllm_allreduce_fusion
    del comm.trtllm_allreduce_fusion
    flashinfer_kernel.kernel_call.cache_clear()
    direct, fusion, errors = calls["direct"], len(calls["fusion"]), []
    try:
        torch.manual_seed(3 + rank)
        x, res = torch.randn(2, 8, 64, dtype=torch.bfloat16).unbind(0)
        w = (0.1 * torch.randn(64)).to(torch.bfloat16)
        got = torch.ops.arfusion.fused_allreduce_rmsnorm(
            x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=group_name, norm="rms",
            quant="none", quant_scale=None, emit_norm=True, backend="flashinfer")
        want = reference.unfused(x, res, w, 1e-6, group_name, PLAIN)
        errors += [i for i, (g, r) in enumerate(zip(got, want)) if not torch.allclose(g.float(), r.float(),
                                                                                         atol=0.05, rtol=0.02)]
        plain = torch.ops.arfusion.all_reduce(x=x, group_name=group_name, backend="flashinfer")
        errors += ["plain"] if not torch.equal(plain, reference.all_reduce_sum(x, group_name)) else []
    finally:
        comm.trtllm_allreduce_fusion = kernel
        flashinfer_kernel.kernel_call.cache_clear()
    return {"direct": calls["direct"] - direct, "unified": len(calls["fusion"]) - fusion, "errors": errors}


def bound_scenario(calls, backend, group_name, rank):
    """Later calls of a signature (a site's, a plain all-reduce's) take its bound kernel call (no
    metadata check); a grown or freed workspace makes it prepare, run and bind again
    (execution.Routed, kernel.bound)."""
    import arfusion

    errors, unchecked, creates, steps = [], calls["unchecked"], len(calls["create"]), []
    arfusion.reset_stats()

    def one(shape, residual=True, seed=0, scratch=False, max_bytes=None, norm="rms", transposed=False):
        torch.manual_seed(100 * seed + rank)
        x = torch.randn(*shape, dtype=torch.bfloat16)
        if transposed:  # the same shape and signature, not dense: the bound call reads a dense copy
            x = torch.randn(*reversed(shape), dtype=torch.bfloat16).t()
        res = torch.randn(*shape, dtype=torch.bfloat16) if residual else None
        w = (1 + 0.1 * torch.randn(shape[-1])).to(torch.bfloat16)
        want = reference.unfused(x, res, w, 1e-6, group_name, Form(residual=residual, norm=norm))
        args = (x, res, w, 1e-6, None, group_name, norm, "none", None, True, "flashinfer", max_bytes)
        got = (torch.ops.arfusion.fused_allreduce_rmsnorm_ if scratch else torch.ops.arfusion.fused_allreduce_rmsnorm)(*args)
        if scratch:  # padded to MAX_OUTPUTS with empty tensors
            errors.extend(f"{shape}: padding {i}" for i, t in enumerate(got[2:]) if t.numel())
            got = got[:2]
        for name, g, r in zip(("residual", "norm"), got, want):
            if g.shape != x.shape or not g.is_contiguous() or not torch.allclose(g.float(), r.float(), atol=0.05,
                                                                                   rtol=0.02):
                errors.append(f"{shape} seed {seed} {name}: {list(g.shape)}, max diff {(g.float() - r.float()).abs().max()}")
        steps.append(calls["unchecked"] - unchecked)

    for seed in range(3):
        one((2, 3, 64), seed=seed, scratch=seed > 0)  # run (checked), then bound twice
    for seed in range(2):
        one((5, 64), residual=False, seed=seed)  # the zero residual, bound with the signature
    for seed in range(2):
        one((4, 64), norm="gemma_rms", seed=seed)  # Gemma's norm: (1 + weight), bound with weight_bias 1
    one((4, 64), norm="gemma_rms", seed=2, transposed=True)
    for seed in range(2):  # the plain fast all-reduce (kAllReduce): bound on its second call too
        torch.manual_seed(100 * seed + rank)
        x = torch.randn(3, 7, 64, dtype=torch.bfloat16)
        got = torch.ops.arfusion.all_reduce(x=x, group_name=group_name, backend="flashinfer")
        if got.shape != x.shape or not torch.equal(got, reference.all_reduce_sum(x, group_name)):
            errors.append(f"plain seed {seed}: {list(got.shape)}")
        steps.append(calls["unchecked"] - unchecked)
    one((8192, 64), max_bytes=8192 * 64 * 2)  # outgrows the workspace: a larger one
    one((2, 3, 64), seed=4)  # bound to the outgrown one: runs (checked) and binds again
    one((2, 3, 64), seed=5)
    backend.close()  # frees the workspaces: the next call makes one
    one((2, 3, 64), seed=6)
    one((2, 3, 64), seed=7)
    return {"errors": errors, "unchecked_after_each": steps, "created": len(calls["create"]) - creates,
            "dispatch": arfusion.stats()["dispatch"]}


QUANT_SITES = [Form(residual=r, norm=n, quant=q, emit_norm=e)
               for q in ("fp8_static", "fp8_dynamic", "fp8_group", "nvfp4") for r in (True, False)
               for e in (False, True) for n in (("rms", "gemma_rms") if r and e else ("rms",))]
NVFP4_GLOBAL_SCALE = 0.004  # torchao's per-tensor scale (dequantizing side)


def quant_scenario(calls, group_name, rank):
    """Every FP8 site through the real op on the stand-in: what FlashInfer was asked, and
    what came back, per site (runs inside a gloo worker)."""
    import arfusion
    from arfusion import quant

    compiled_fns = []
    real_compiled, real_facts, real_cuda = runtime.compiled, fi.device_facts, torch.version.cuda
    runtime.compiled = lambda fn: compiled_fns.append(fn.__name__) or fn  # no Inductor in the workers
    out = {}
    # NVFP4 runs on a pretend B200 with CUDA 12.8, and once more on the H200 (SM90: declined).
    sites = [(site, "sm100" if site.quant == "nvfp4" else "sm90") for site in QUANT_SITES]
    sites.append((Form(residual=True, norm="rms", quant="nvfp4", emit_norm=False), "sm90"))
    try:
        for site, gpu in sites:
            if gpu == "sm100":
                fi.device_facts, torch.version.cuda = (lambda index: replace(B200, uuid=f"GPU-fake-{rank}")), "12.8"
            else:
                fi.device_facts, torch.version.cuda = real_facts, real_cuda
            tables_changed()  # another GPU in the same process: routes by signature are stale
            calls["fusion"].clear()
            arfusion.reset_stats()
            torch.manual_seed(7 + rank)
            x = torch.randn(2, 3, 256, dtype=torch.bfloat16)  # 3-D: outputs keep the leading dims
            torch.manual_seed(8)
            res = torch.randn(2, 3, 256, dtype=torch.bfloat16) if site.residual else None
            w = (1 + 0.1 * torch.randn(256)).to(torch.bfloat16)
            scale = {"fp8_static": torch.tensor(0.02), "nvfp4": torch.tensor(NVFP4_GLOBAL_SCALE)}.get(site.quant)
            got = torch.ops.arfusion.fused_allreduce_rmsnorm(
                x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=group_name, norm=site.norm,
                quant=site.quant, quant_scale=scale, emit_norm=site.emit_norm, backend="flashinfer")
            want = reference.unfused(x, res, w, 1e-6, group_name, site, scale)
            named_got, named_want = dict(zip(site.outputs(), got)), dict(zip(site.outputs(), want))
            errors = []
            for name in ("residual", "norm"):
                if name in named_got and not torch.allclose(named_got[name].float(), named_want[name].float(),
                                                            atol=0.05, rtol=0.02):
                    errors.append(name)
            q_scale = (scale, scale) if site.quant == "fp8_static" else (named_got["scale"], named_want["scale"])
            global_scale = scale if site.quant == "nvfp4" else None
            deq = [quant.dequantize(named[("quant")], s_, site.quant, global_scale)
                   for named, s_ in ((named_got, q_scale[0]), (named_want, q_scale[1]))]
            # The stand-in's norm rounds like the kernel (fp32 weight multiply), the reference like
            # HF (bf16): with NVFP4 that can move a block scale by one E4M3 step (<= 12.5%) and its
            # values by one E2M1 step. A wrong scale_factor convention is off by ~100%.
            tol = 0.15 if site.quant == "nvfp4" else 2e-2
            if ((deq[0] - deq[1]).norm() / deq[1].norm()).item() > tol:
                errors.append("quant")
            if "scale" in named_got and not torch.allclose(named_got["scale"].float(), named_want["scale"].float(),
                                                           rtol=0.13 if site.quant == "nvfp4" else 1e-2):
                errors.append("scale")
            out[site.name + ("_sm90" if site.quant == "nvfp4" and gpu == "sm90" else "")] = dict(
                errors=errors, fusion=list(calls["fusion"]), dispatch=arfusion.stats()["dispatch"],
                outputs={n: [list(t.shape), str(t.dtype)] for n, t in named_got.items()},
                expected={n: [list(t.shape), str(t.dtype)] for n, t in named_want.items()})
    finally:
        runtime.compiled, fi.device_facts, torch.version.cuda = real_compiled, real_facts, real_cuda
        tables_changed()
    out["compiled"] = compiled_fns
    return out


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """One pair of gloo processes runs every scenario (starting processes is the slow part)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiproc
@pytest.mark.slow
def test_workspace_created_once_per_group_reused_and_grown(two_rank_results):
    for rank, results in enumerate(two_rank_results):
        result = results["ok"]
        assert result["errors"] == [] and result["declined"] is None and result["failed"] is None
        creates = result["creates"]
        assert [c["backend"] for c in creates] == ["trtllm", "trtllm"]  # never "auto" / "mnnvl"
        assert all(c["group"] == "0" and c["world_size"] == 2 and c["rank"] == rank
                   and c["hidden_dim"] == 64 for c in creates)
        assert [c["max_token_num"] for c in creates] == [1024, 4096]
        # torch's symmetric memory without NVLink multicast while FlashInfer allocates, then the
        # process's own setting again.
        assert all(c["symm_mem_multicast_off"] == "1" for c in creates) and result["multicast_env_after"] == "0"
        assert result["retired"] == 1  # kept alive: captured graphs may still point into it
        fusion = {f["tokens"]: f for f in result["fusion"] if f["pattern"] != 0}
        assert all(f["pattern"] == 1 and f["fp32_acc"] is True and f["rms_eps"] == 1e-6
                   and f["trigger_at_end"] is True for f in fusion.values())
        assert fusion[40]["weight_bias"] == 1.0 and fusion[8]["weight_bias"] == 0.0
        assert fusion[3]["residual_all_zero"]
        assert fusion[2]["use_oneshot"] and not fusion[100]["use_oneshot"] and fusion[8]["use_oneshot"]
        assert result["dispatch"] == {"flashinfer": 4, "flashinfer all-reduce": 2}  # forced calls: the kernel alone
        # Every kernel call went straight to trtllm_allreduce_fusion, past its deprecation warning.
        assert result["direct"] == len(result["fusion"]) == 8 and result["deprecations"] == []
        plain = [f for f in result["fusion"] if f["pattern"] == 0]
        assert [f["tokens"] for f in plain] == [10, 40] and all(
            f["use_oneshot"] and f["output"] and not f["residual_in"] and not f["rms_gamma"] and f["fp32_acc"]
            and f["trigger_at_end"] for f in plain)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_flashinfer_without_the_kernel_call_runs_the_unified_api(two_rank_results):
    for results in two_rank_results:
        assert results["unified"] == {"direct": 0, "unified": 2, "errors": []}


@pytest.mark.multiproc
@pytest.mark.slow
def test_later_calls_of_a_signature_take_its_bound_kernel_call(two_rank_results):
    for results in two_rank_results:
        bound = results["bound"]
        assert bound["errors"] == []
        # Bound calls skip FlashInfer's metadata check: the 2nd and 3rd call of a signature, the
        # zero-residual one's 2nd, the Gemma-norm one's 2nd and 3rd (x not dense), the plain
        # all-reduce's 2nd; none after a workspace changed until the signature ran again.
        assert bound["unchecked_after_each"] == [0, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6, 6, 7, 7, 8]
        assert bound["created"] == 2 and bound["dispatch"] == {"flashinfer": 13, "flashinfer all-reduce": 2}


@pytest.mark.multiproc
@pytest.mark.slow
def test_groups_of_the_same_ranks_share_one_workspace(two_rank_results):
    for results in two_rank_results:
        shared = results["shared"]
        assert shared["errors"] == [] and shared["same_state"] and shared["states"] == 1
        # One workspace for both groups; grown once, by the twin's larger call, for both.
        assert shared["made_after_each"] == [1, 1, 2, 2, 2]
        assert shared["destroyed"] == [True, True]


@pytest.mark.multiproc
@pytest.mark.slow
def test_an_empty_batch_never_enters_the_kernel(two_rank_results):
    for results in two_rank_results:
        empty = results["empty"]
        assert empty["errors"] == []
        assert 0 not in empty["kernel_tokens"] and 4 in empty["kernel_tokens"]
        # 4 tokens: both sites and the combine's site by the kernel, the plain all-reduce too;
        # 0 tokens: the three fused ops unfused, the plain one on torch's all-reduce.
        assert empty["dispatch"] == {"flashinfer": 3, "flashinfer all-reduce": 1, "fallback": 3, "all-reduce": 1}
        assert empty["logged"], "no INFO line says why"


@pytest.mark.parametrize("name", ["fail_build", "fail_create", "low_memory"])
@pytest.mark.multiproc
@pytest.mark.slow
def test_failure_on_one_rank_makes_every_rank_fall_back(two_rank_results, name):
    results = [r[name] for r in two_rank_results]
    for result in results:
        assert result["errors"] == []  # the unfused fallback still computed the right answer
        assert result["dispatch"] == {"fallback": 1}
        assert result["fusion"] == []
        assert result["group"] != "0"
        # Every later call on the group is declined at run time with the recorded failure, no retry.
        assert result["declined"] == Why.RUNTIME.value and result["declined_message"] == result["failed"]
    if name in ("fail_build", "low_memory"):
        assert all(r["creates"] == [] for r in results)  # agreement came before creation
    else:  # rank 1 raised inside FlashInfer's creation; rank 0, in the handle exchange, gave up on it
        assert len(results[0]["creates"]) == 1 and all(r["multicast_env_after"] == "0" for r in results)
        assert "did not reach FlashInfer's handle exchange" in results[0]["failed"], results[0]["failed"]
        assert "cuMemCreate" in results[1]["failed"]  # the library's own error, passed on
    if name == "low_memory":
        assert "MiB free on this rank's GPU" in results[1]["failed"], results[1]["failed"]
        assert results[0]["failed"] == "FlashInfer kernels or memory unavailable on another rank of the group"


@pytest.mark.multiproc
@pytest.mark.slow
def test_quant_sites_run_the_right_flashinfer_pattern(two_rank_results):
    codes = {("fp8_static", False): 2, ("fp8_static", True): 4, ("fp8_dynamic", False): 10,
             ("fp8_dynamic", True): 11, ("fp8_group", False): 1, ("fp8_group", True): 1,
             ("nvfp4", False): 3, ("nvfp4", True): 5}
    for results in two_rank_results:
        quant = results["quant"]
        for site in QUANT_SITES:
            got = quant[site.name]
            assert got["errors"] == [], site.name
            assert got["dispatch"] == {"flashinfer": 1}, site.name
            [fusion] = got["fusion"]  # one FlashInfer launch per site
            assert fusion["pattern"] == codes[site.quant, site.emit_norm], site.name
            assert fusion["weight_bias"] == (1.0 if site.norm == "gemma_rms" else 0.0)
            assert fusion["residual_all_zero"] == (not site.residual)
            # the contract: names, order, shapes and dtypes exactly as the reference gives them
            assert list(got["outputs"]) == list(site.outputs())
            assert got["outputs"] == got["expected"], site.name
            assert got["outputs"]["quant"][1] == ("torch.uint8" if site.quant == "nvfp4" else "torch.float8_e4m3fn")
            if site.quant == "nvfp4":
                # scale_factor: the reciprocal of the site's global scale (FlashInfer's FP4
                # kernel multiplies by it); block scales row-major, 16 elements each
                assert fusion["scale_factor"] == dict(type="Tensor", dtype="torch.float32", shape=[1], device="cpu",
                                                      same_device=True, value=pytest.approx(1 / NVFP4_GLOBAL_SCALE))
                assert fusion["layout_code"] == 2
                assert fusion["scale_out"] == [[6, 16], "torch.float8_e4m3fn"]
                assert got["outputs"]["quant"] == [[2, 3, 128], "torch.uint8"]
                assert got["outputs"]["scale"] == [[2, 3, 16], "torch.float8_e4m3fn"]
            elif site.quant == "fp8_static":
                # fp32 1-element tensor on the input's device, never a Python float
                assert fusion["scale_factor"] == dict(type="Tensor", dtype="torch.float32", shape=[1],
                                                      device="cpu", same_device=True, value=pytest.approx(0.02))
            else:
                assert fusion["scale_factor"] is None
            if site.quant == "fp8_dynamic":
                assert fusion["scale_out"] == [[6, 1], "torch.float32"]
                assert got["outputs"]["scale"] == [[2, 3, 1], "torch.float32"]
            if site.quant == "fp8_group":  # code 1 writes the norm; one quant kernel follows
                assert fusion["norm_out"] and not fusion["quant_out"] and fusion["scale_out"] is None
                assert got["outputs"]["scale"] == [[2, 3, 2], "torch.float32"]
            else:
                assert fusion["norm_out"] == site.emit_norm and fusion["quant_out"]
        assert quant["compiled"] == ["fp8_group"] * sum(s.quant == "fp8_group" for s in QUANT_SITES)
        # SM90: NVFP4 is never handed to FlashInfer (its kernel writes zeros there); the op
        # computes the reference instead, and the answer is still right
        declined = quant["allreduce_add_rmsnorm_nvfp4_sm90"]
        assert declined["fusion"] == [] and declined["dispatch"] == {"fallback": 1}
        assert declined["errors"] == [] and declined["outputs"] == declined["expected"]


@pytest.mark.parametrize("quant", ["fp8_static", "fp8_dynamic"])
def test_quant_sites_share_the_unquantized_thresholds(backend, quant):
    # Measured on H200 (docs/history/2026-11-26-benchmarks-before-the-matrix.md, "FP8 quant rows"):
    # the FP8 rows cross over where the plain rows do.
    for emit_norm in (False, True):
        site = Form(residual=True, norm="rms", quant=quant, emit_norm=emit_norm)
        assert backend.why_not(call(1024, site=site)) is None
        assert backend.why_not(call(1025, site=site)).code is Why.SIZE_CAP
        assert backend.use_oneshot(call(256, site=site)) and not backend.use_oneshot(call(257, site=site))


@pytest.mark.parametrize("world", [2, 4])
def test_per_group_fp8_has_its_own_cap(backend, world):
    """4 MiB per rank at worlds 2 and 4 on SM90 (GROUP_QUANT_MAX_MIB): fused 1.22x / 1.01x there
    against NCCL in place, 0.80x at 16 MiB at world 2 (4xH200, 2026-11-28)."""
    group = Form(residual=True, norm="rms", quant="fp8_group")
    assert backend.why_not(call(512, world=world, site=group)) is None  # 4 MiB at hidden 4096
    assert backend.why_not(call(513, world=world, site=group)).code is Why.SIZE_CAP
    assert backend.why_not(call(513, world=world)) is None  # the plain site: the table's cap
    assert backend.why_not(call(1024, world=world, site=group), max_bytes_override=8 * MiB) is None  # user's cap wins


def test_per_group_fp8_on_sm100_takes_the_sm90_cap(backend, monkeypatch):
    """Unmeasured on Blackwell, whose table fuses up to 64 MiB at world 2: the measured cap holds there too."""
    monkeypatch.setattr(fi, "device_facts", lambda index: B200)
    group = Form(residual=True, norm="rms", quant="fp8_group")
    assert backend.why_not(call(512, world=2, site=group)) is None
    assert backend.why_not(call(513, world=2, site=group)).code is Why.SIZE_CAP
    assert backend.why_not(call(4096, world=2)) is None  # the plain site: SM100's own 64 MiB


@pytest.mark.parametrize("world,last_fused", [(2, 1024), (4, 512)])  # 8 and 4 MiB at hidden 4096
def test_a_scaled_input_has_its_own_cap(backend, world, last_fused):
    """f * AR(x) runs one more pass over x where the kernel runs (SCALED_INPUT_MAX_MIB)."""
    scaled = replace(call(last_fused, world=world), input_scaled=True)
    assert backend.why_not(scaled) is None
    assert backend.why_not(replace(scaled, tokens=last_fused + 1)).code is Why.SIZE_CAP
    assert backend.why_not(replace(scaled, tokens=last_fused + 1, input_scaled=False)) is None  # plain table
    assert backend.why_not(replace(scaled, tokens=4 * last_fused), max_bytes_override=64 * MiB) is None  # user's cap


def test_quant_guards(backend):
    group = Form(residual=True, norm="rms", quant="fp8_group")
    assert backend.why_not(call(8, hidden=4096 + 64, site=group)).code is Why.SHAPE


@pytest.mark.parametrize("emit_norm", [False, True])
def test_nvfp4_goes_to_flashinfer_only_on_sm100_with_cuda_12_8(backend, monkeypatch, emit_norm):
    fp4 = Form(residual=True, norm="rms", quant="nvfp4", emit_norm=emit_norm)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert backend.why_not(call(8, site=fp4)).code is Why.GPU_ARCH  # the H200: it would write zeros
    monkeypatch.setattr(fi, "device_facts", lambda index: B200)
    assert backend.why_not(call(8, site=fp4)) is None
    assert backend.why_not(call(8, hidden=4096 + 8, site=fp4)).code is Why.SHAPE
    assert backend.why_not(call(8, dtype=torch.float32, site=fp4)).code is Why.DTYPE
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    assert backend.why_not(call(8, site=fp4)).code is Why.GPU_ARCH


# ----------------------------------------------------------------- the command line


def test_cli_table_and_tune_outside_torchrun(backend, capsys, monkeypatch):
    from arfusion import cli

    assert cli.main(["table"]) == 0
    out = capsys.readouterr().out
    assert "SM" in out and "SM9x world 2 launch knobs: from 8 MiB block_size=16384" in out
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["tune", "--hidden", "4096"]) == 2
    assert "torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the knobs are the quantized all-reduce's
        cli.main(["tune", "--hidden", "4096", "--knobs"])
    assert "--quantized fp8" in capsys.readouterr().err


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails: the text bar is used
    bar = tuning.Progress(2, "tune")
    bar.update("T=1")
    bar.update("T=2")
    bar.close()
    assert "2/2" in capsys.readouterr().err


# ----------------------------------------------------------------- the plain fast-path all-reduce

PLAIN_ALL_REDUCE = core.PLAIN


@pytest.mark.parametrize("world,hidden,last_plain", [(2, 4096, 512), (4, 4096, 128), (8, 4096, 64), (2, 8192, 256)])
def test_plain_all_reduce_cap_is_inclusive(backend, world, hidden, last_plain):
    assert backend.plain_why_not(call(last_plain, hidden, world, site=PLAIN_ALL_REDUCE)) is None
    reason = backend.plain_why_not(call(last_plain + 1, hidden, world, site=PLAIN_ALL_REDUCE))
    assert reason.code is Why.SIZE_CAP


def test_plain_all_reduce_guards(backend):
    plain = dict(site=PLAIN_ALL_REDUCE)
    assert backend.plain_why_not(call(8, world=3, **plain)).code is Why.WORLD_SIZE
    assert backend.plain_why_not(call(8, world=16, **plain)).code is Why.NO_TABLE
    assert backend.plain_why_not(call(8, dtype=torch.float32, **plain)).code is Why.DTYPE
    assert backend.plain_why_not(call(8, hidden=4100, **plain)).code is Why.SHAPE
    assert backend.plain_why_not(call(None, **plain)) is None  # symbolic tokens: decided per call
    assert backend.plain_why_not(call(4096, world=2, **plain), 64 * MiB) is None  # the user's cap wins...
    assert backend.plain_why_not(call(16384, hidden=8192, world=2, **plain), 1 << 40).code is Why.SIZE_CAP  # ...up to 64 MiB


def test_the_plain_table_is_part_of_what_ranks_compare():
    before = dispatch.table_hash()
    dispatch.PLAIN_MAX_MIB[(9, 2)] += 1
    try:
        assert dispatch.table_hash() != before
    finally:
        dispatch.PLAIN_MAX_MIB[(9, 2)] -= 1


def test_plain_crossover_stops_at_the_first_loss_against_nccl():
    rows = [tuning.Measured(t, 20.0, 10.0, None, nccl_us=nccl, plain_us=plain)
            for t, nccl, plain in ((1, 9.0, 5.0), (64, 10.0, 6.0), (512, 30.0, 31.0), (1024, 60.0, 50.0))]
    assert tuning.plain_crossover(rows) == 64  # the later win at 1024 never re-enables 512
    assert tuning.plain_crossover(rows[2:]) == 0
    entry = {"max_fused_tokens": 64, "oneshot_max_tokens": 64, "plain_max_tokens": 64,
             "measured": [vars(r) for r in rows]}
    text = tuning.format_rows(entry)
    assert "plain all-reduce up to 64 tokens" in text and "nccl us" in text
