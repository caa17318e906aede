"""The aiter backend: AMD Instinct GPUs (gfx942 = MI300 series, gfx950 = MI350 series).

Fused sites run the stages of `stages` (one kernel with the quant, one kernel then the quant,
unfused); plain all-reduces run aiter's custom all-reduce (`plain`); the opt-in quantized
all-reduce runs aiter's quick all-reduce (`quick_reduce`). One CustomAllreduce per group serves
the fused and the plain all-reduce, made on the group's first eager call (`communicator`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import reference, runtime
from ...core import QUANT_FORMS, Call
from ...decisions import Reason, Why
from ...runtime import PerGroup, log_once, outside_graph_pools
from ..base import Backend, Capabilities, over_cap
from . import communicator
from .detection import Detected, detect, quant_disabled_by_env
from .limits import LIMITS, MIB, QUICK_REDUCE_REGIMES
from .plain import plain_problem, sum_or_torch
from .quick_reduce import (QuickReduceGroup, quick_reduce_api, quick_reduce_env, quick_reduce_kernel_dtype,
                           set_up_quick_reduce)
from .stages import STAGES, attempt, inputs, legacy_shape_problem, pack_elements, plan


@dataclass
class AiterBackend(Backend):
    name: str = "aiter"
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(
        device_types=frozenset({"cuda"}),  # ROCm torch calls its GPUs "cuda"
        dtypes=frozenset({torch.bfloat16, torch.float16}),  # aiter's fused kernels: 16-bit only
        # Forms without a kernel use stage 2. Not NVFP4: aiter has MXFP4 (E8M0 scales per 32),
        # not NVFP4, and no AMD GPU consumes NVFP4 activations.
        quants=frozenset({"none", *QUANT_FORMS} - {"nvfp4"}),
        # aiter's quick all-reduce codecs (QuickReduceRegime FP8, INT6, INT4); no INT8.
        codecs=frozenset(QUICK_REDUCE_REGIMES),
    ))
    # Per group, renewed when the name comes to mean another group, and shared by groups of the
    # same ranks (see PerGroup). One CustomAllreduce per group serves its fused sites and its
    # plain all-reduces.
    _communicators: PerGroup = field(default_factory=lambda: PerGroup(
        lambda: None, communicator.resolve_or_none, same_ranks_share=True), repr=False)
    _quick_reduce: PerGroup = field(default_factory=lambda: PerGroup(
        QuickReduceGroup, communicator.resolve_or_none, same_ranks_share=True), repr=False)

    def _detected(self, device: torch.device) -> Detected | str:
        if device.type != "cuda":
            return f"aiter runs on ROCm GPUs only, not on {device.type}"
        try:
            index = runtime.device_index(device)
        except Exception as e:
            return f"no current GPU: {type(e).__name__}: {e}"
        return detect(index)

    def unavailable(self, device: torch.device) -> Reason | None:
        found = self._detected(device)
        return Reason(Why.NO_BACKEND, found) if isinstance(found, str) else None

    def shape_check(self, call: Call) -> Reason | None:
        found = self._detected(call.device)
        if isinstance(found, str):
            return Reason(Why.NO_BACKEND, found)
        pack = pack_elements(call.dtype)
        if call.weight_dtype != call.dtype:
            return Reason(Why.WEIGHT_DTYPE, f"norm weight {call.weight_dtype} differs from input {call.dtype} "
                                            "(vllm#48324)")
        if call.world_size not in LIMITS.world_sizes:
            return Reason(Why.WORLD_SIZE, f"world size {call.world_size} not in {list(LIMITS.world_sizes)}")
        if call.hidden > LIMITS.max_hidden:
            return Reason(Why.SHAPE, f"hidden {call.hidden} > {LIMITS.max_hidden}")
        if call.hidden % pack:
            return Reason(Why.SHAPE, f"hidden {call.hidden} is not a multiple of the pack size {pack}")
        if call.tokens == 0:
            return Reason(Why.SHAPE, "no tokens")
        if call.form.norm == "gemma_rms" and not found.api.gemma_norm:
            return Reason(Why.NORM_FORM, f"aiter {found.api.version} has no gemma_norm")
        if not found.api.flexible_hidden:
            problem = legacy_shape_problem(call.hidden, call.dtype)
            if problem:
                return Reason(Why.SHAPE, problem)
        return over_cap(call, LIMITS.max_bytes, "aiter's limit")

    def default_max_bytes(self, call: Call) -> int | None:
        return LIMITS.max_bytes

    def fingerprint(self) -> str:
        # Never imports aiter: metadata only.
        for dist_name in ("amd-aiter", "aiter"):
            try:
                return f"{dist_name}=={importlib.metadata.version(dist_name)}"
            except importlib.metadata.PackageNotFoundError:
                pass
        return "aiter absent"

    def prepare(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        """Sets up the group's communicator on its first eager call (collective), or says why not."""
        comm = self._ready_communicator(call)
        return Reason(Why.RUNTIME, comm) if isinstance(comm, str) else None

    def run(self, call, x, residual, weight, eps, quant_scale):
        comm = self._ready_communicator(call)  # prepare() made it; this also covers callers without it
        if isinstance(comm, str):
            log_once(f"arfusion: {call.form.name} ran unfused on aiter: {comm}")
            return reference.unfused(x, residual, weight, eps, call.group_name, call.form, quant_scale)
        found = self._detected(call.device)
        inp = inputs(x, residual, weight, eps, quant_scale)
        stages, skipped = plan(call, found, quant_disabled_by_env())
        for reason in skipped:
            log_once(f"arfusion: {call.form.name}: {reason}")
        for stage in stages[:-1]:
            produced, reason = attempt(stage, comm, call, inp, found)
            if produced is not None:
                return [produced[name] for name in call.form.outputs()]
            log_once(f"arfusion: {call.form.name}: aiter {stage} {reason}; trying the next stage")
        # The last stage is the reference math: its errors are real errors, so they propagate.
        produced = STAGES[stages[-1]](comm, call, inp, found)
        return [produced[name] for name in call.form.outputs()]

    def _ready_communicator(self, call: Call) -> Any:
        """The group's CustomAllreduce (created on its first eager call), or why there is none."""
        comm = self._communicators.current(call.group_name)
        if comm is None:
            found = self._detected(call.device)
            if isinstance(found, str):
                return found
            if runtime.capturing():
                return "aiter set-up is not done during CUDA graph capture; run one eager step first"
            comm = outside_graph_pools(
                call.device, lambda: communicator.create_communicator(found.custom_ar, call.group_name, call.device))
            self._communicators[call.group_name] = comm
        return comm

    # ------------------------------------------------------------- plain all-reduce

    def plain_why_not(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        """None if aiter's custom all-reduce takes `call` (`plain.plain_problem`: aiter's dtypes,
        world sizes and (low, high] window, the user's cap), else why not."""
        return plain_problem(call, max_bytes_override) or self.unavailable(call.device)

    def prepare_plain(self, call: Call) -> Reason | None:
        """The group's CustomAllreduce (the fused sites' one), made on its first eager call
        (collective, outside graph pools, never during capture), or why there is none."""
        comm = self._ready_communicator(call)
        return Reason(Why.RUNTIME, comm) if isinstance(comm, str) else None

    def all_reduce(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        """`CustomAllreduce.custom_all_reduce(x)`; torch's all-reduce where it gives nothing."""
        comm = self._ready_communicator(call)  # prepare_plain() made it; this covers callers without it
        if isinstance(comm, str):
            log_once(f"arfusion: a plain all-reduce ran torch's all-reduce, not aiter's: {comm}")
            return reference.all_reduce_sum(x, call.group_name)
        return sum_or_torch(comm, x, call.group_name)

    # ------------------------------------------------------------- quick all-reduce (quantized)

    def codec_why_not(self, call: Call, level: str, min_bytes_override: int | None = None) -> Reason | None:
        if level not in QUICK_REDUCE_REGIMES:
            return Reason(Why.NO_KERNEL, f"aiter's quick all-reduce has no {level} codec (its QuickReduceRegime "
                                         "levels are FP8, INT6 and INT4; level 1 is FP8, not INT8): choose one of "
                                         f"{sorted(QUICK_REDUCE_REGIMES)}")
        return super().codec_why_not(call, level, min_bytes_override)

    def codec_problem(self, call: Call, level: str) -> Reason | None:
        """What QuickAllReduce._should_hip and the kernel accept (the arch is `detect`'s)."""
        if call.dtype not in LIMITS.quick_reduce_dtypes:
            return Reason(Why.DTYPE, f"aiter's quick all-reduce takes float16 or bfloat16, not {call.dtype}")
        if call.world_size not in LIMITS.quick_reduce_world_sizes:
            return Reason(Why.WORLD_SIZE, "aiter's quick all-reduce takes world sizes "
                                          f"{list(LIMITS.quick_reduce_world_sizes)}, not {call.world_size}")
        api = quick_reduce_api()
        if isinstance(api, str):
            return Reason(Why.NO_KERNEL, api)
        if level not in api.levels:
            return Reason(Why.NO_KERNEL, f"this aiter's QuickReduceRegime has no {QUICK_REDUCE_REGIMES[level]} member")
        env = quick_reduce_env()
        if isinstance(env, str):
            return Reason(Why.NO_BACKEND, env)
        if call.nbytes is not None:
            if call.nbytes == 0:
                return Reason(Why.SHAPE, "no tokens")
            if call.nbytes % LIMITS.quick_reduce_align_bytes:
                return Reason(Why.SHAPE, f"{call.nbytes} bytes per rank is not a multiple of "
                                         f"{LIMITS.quick_reduce_align_bytes} (aiter's quick all-reduce)")
            return over_cap(call, env.max_bytes, "aiter's quick all-reduce buffer")
        return None

    def codec_min_bytes(self, call: Call, level: str) -> tuple[int | None, str]:
        env = quick_reduce_env()
        if isinstance(env, str):
            return None, env
        kernel = quick_reduce_kernel_dtype(call.dtype, env)
        mib = LIMITS.quick_reduce_min_mib.get((kernel, call.world_size), {}).get(level)
        name = str(kernel).removeprefix("torch.")
        if mib is None:
            return None, (f"no aiter quick all-reduce threshold for {level}, {name} kernels, "
                          f"world size {call.world_size}")
        return mib * MIB, (f"aiter's own quick all-reduce threshold, _QR_MIN_SIZE[({name}, {call.world_size})] "
                           f"{QUICK_REDUCE_REGIMES[level]} = {mib} MiB: measured by aiter against its custom "
                           "all-reduce, not against arfusion's fused kernel (no AMD GPU here)")

    def prepare_codec(self, call: Call, level: str) -> Reason | None:
        """The group's quick all-reduce, set up once on an eager call (collective), or why not.
        One communicator serves every level: the level is an argument of each call."""
        state = self._quick_reduce.current(call.group_name)
        if state.failed or state.ptr is not None:
            return Reason(Why.RUNTIME, state.failed) if state.failed else None
        if runtime.capturing():
            return Reason(Why.RUNTIME, "aiter's quick all-reduce is never set up during CUDA-graph capture: run "
                                       "the model once eagerly first")
        problem = outside_graph_pools(
            call.device, lambda: set_up_quick_reduce(state, call.group_name, call.world_size))
        return Reason(Why.RUNTIME, problem) if problem else None

    def codec_all_reduce(self, call: Call, x: torch.Tensor, level: str) -> torch.Tensor:
        api, env = quick_reduce_api(), quick_reduce_env()
        out = torch.empty_like(x)
        api.ops.qr_all_reduce(self._quick_reduce[call.group_name].ptr, x, out, api.levels[level],
                              env.cast_bf16)
        return out

    def close(self) -> None:
        """Free aiter's buffers (collective: call on every rank, at teardown)."""
        for comm in self._communicators.everything():
            if comm is not None and not isinstance(comm, str):
                comm.close()
        self._communicators.clear()
        live = [s for s in self._quick_reduce.everything() if s.ptr is not None]
        if live and torch.cuda.is_available():
            try:
                torch.cuda.synchronize()  # no quick all-reduce still reading the buffers
            except Exception:
                pass
        for state in live:
            try:
                state.destroy(state.ptr)
            except Exception:  # interpreter shutdown may have torn aiter down already
                pass
        self._quick_reduce.clear()
