"""FlashInfer backend: all-reduce + residual add + RMSNorm (+ quant) in one kernel on NVIDIA GPUs.

Static and dynamic per-token FP8 are quantized inside FlashInfer's kernel, and so is NVFP4 on
SM100+ only (dispatch.QUANT_MIN_SM); per-group FP8 runs the plain kernel and then one compiled
quant kernel (see QUANT_KERNELS).

An all-reduce that is not a site runs the plain one-shot kernel (kAllReduce) on the same
workspace. The MoE finalize kernel is in flashinfer_moe.py, the quantized all-reduce in
flashinfer_codec.py, the ranks' set-up agreement in flashinfer_exchange.py.

Built on `flashinfer.comm` (flashinfer-python 0.7.2.post1): `create_allreduce_fusion_workspace`,
always with backend="trtllm" ("auto" would pick "mnnvl", NVLink multicast, on NVSwitch machines;
never multicast: see flashinfer_exchange.py), and its kernel call (flashinfer_kernel.py).

The per-group workspace lives inside the op, at run time (a warm FX-graph cache skips the pass):
  * made on the first eager call that wants it, never during capture (a capture without one declines);
  * collectively: readiness and environment compared, then made, then its success confirmed; any
    failure anywhere makes every rank fall back, so no rank waits in a kernel its peers never enter;
  * sized for the largest fused input, reused while `is_buffer_size_sufficient`; an outgrown one
    is kept alive (graphs may still point into it); destroyed at exit.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import math
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import quant, runtime
from ..decisions import Reason, Why
from ..core import NORM_FORMS, PLAIN, Call, flatten_tokens
from ..runtime import PerGroup, all_ranks_agree, comm_device, hash63, outside_graph_pools
from . import flashinfer_dispatch as dispatch
from . import flashinfer_exchange as exchange
from . import flashinfer_kernel as kernel
from .flashinfer_moe import FinalizeWorkspaces, MoEFinalize
from .flashinfer_codec import WORLD_SIZES, CodecState, QuantizedAllReduce
from .base import Backend, Capabilities, over_cap

log = logging.getLogger("arfusion")

# FlashInfer's deprecated entry points, where one is called (flashinfer_kernel.py).
warnings.filterwarnings("ignore", message="use the unified API allreduce.py", category=DeprecationWarning)

FI_BACKEND = "trtllm"  # the only FlashInfer backend this module ever asks for

# (Form.quant, Form.emit_norm) -> the AllReduceFusionPattern member that computes the site. Per-group
# FP8 runs code 1, then one compiled quant kernel (codes 8/9 write packed UE8M0 int32 scales, not fp32
# [T, H/128]). NVFP4 (codes 3/5) only where dispatch.quant_problem allows (SM100+; SM90 writes zeros).
QUANT_KERNELS = {
    "none": {True: "kARResidualRMSNorm"},
    "fp8_static": {False: "kARResidualRMSNormFP8Quant", True: "kARResidualRMSNormOutFP8Quant"},
    "fp8_dynamic": {False: "kARResidualRMSNormDynamicFP8Quant", True: "kARResidualRMSNormOutDynamicFP8Quant"},
    "fp8_group": {False: "kARResidualRMSNorm", True: "kARResidualRMSNorm"},
    "nvfp4": {False: "kARResidualRMSNormFP4Quant", True: "kARResidualRMSNormOutFP4Quant"},
}
IN_KERNEL_QUANTS = ("fp8_static", "fp8_dynamic", "nvfp4")  # FlashInfer writes quant (and scale) itself


@dataclass(frozen=True)
class DeviceFacts:
    sm: tuple[int, int]
    name: str
    uuid: str


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts((props.major, props.minor), props.name, str(props.uuid))


def _flashinfer_version() -> str:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown" if importlib.util.find_spec("flashinfer") is not None else "missing"


@dataclass
class _GroupState:
    """FlashInfer's workspaces of one process group, shared by its groups of the same ranks."""

    workspace: Any = None
    capacity_elems: int = 0  # input elements per rank the workspace holds
    failed: str | None = None  # set on every rank at once; the group then stays unfused
    retired: list = field(default_factory=list)  # outgrown workspaces that graphs may still use
    zeros: dict = field(default_factory=dict)  # dtype -> zero residual for sites without one
    finalize: "FinalizeWorkspaces | None" = None
    finalize_failed: str | None = None  # set on every rank at once; the combine then runs in torch


@dataclass
class FlashInferBackend(MoEFinalize, QuantizedAllReduce, Backend):
    name: str = "flashinfer"
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset(dispatch.HALF_DTYPES),
        norms=frozenset(NORM_FORMS),
        quants=frozenset(QUANT_KERNELS),
        world_sizes=WORLD_SIZES,
        residual_optional=True,  # fed a zero residual: no FlashInfer pattern norms without one
        codecs=frozenset({"fp8"}),  # quantized_all_reduce: FP8 e4m3 payload only
        moe_combine_needs_other_collective=True,
    ))
    # Kernel launch knobs. PDL lets the kernel's launch overlap the previous kernel's tail;
    # completion is always signalled at the end (early completion with one-shot gave NaN,
    # vllm#45448, and nothing after us waits on an early signal anyway). fp32 accumulation
    # keeps the cross-rank sum as exact as the fp32 RMS that follows.
    launch_with_pdl: bool = True
    fp32_acc: bool = True
    _groups: PerGroup = field(default_factory=lambda: PerGroup(_GroupState, same_ranks_share=True), repr=False)
    _codecs: PerGroup = field(default_factory=lambda: PerGroup(CodecState), repr=False)  # FlashInfer's: per group

    def __post_init__(self) -> None:
        atexit.register(self.close)

    # ------------------------------------------------------------- static decisions

    def unavailable(self, device: torch.device) -> Reason | None:
        if device.type != "cuda" or torch.version.hip:
            return Reason(Why.NO_BACKEND, "needs an NVIDIA CUDA device")
        problem = _environment_problem(runtime.device_index(device))
        return Reason(Why.NO_BACKEND, problem) if problem else None

    def shape_check(self, call: Call) -> Reason | None:
        if call.weight_dtype != call.dtype:
            # The kernel reinterprets gamma as the input dtype: garbage otherwise (vllm#48324).
            return Reason(Why.WEIGHT_DTYPE, f"RMSNorm weight dtype {call.weight_dtype} != input dtype {call.dtype}")
        if call.hidden % 8:
            return Reason(Why.SHAPE, f"hidden size {call.hidden} is not a multiple of 8")
        if call.form.emit_norm not in QUANT_KERNELS[call.form.quant]:
            return Reason(Why.NO_KERNEL, f"no FlashInfer pattern for {call.form.name}")
        if call.form.quant == "fp8_group" and call.hidden % quant.GROUP_SIZE:
            return Reason(Why.SHAPE, f"hidden size {call.hidden} is not a multiple of the FP8 group size "
                                     f"{quant.GROUP_SIZE}")
        if call.form.quant == "nvfp4" and call.hidden % quant.NVFP4_BLOCK:
            return Reason(Why.SHAPE, f"hidden size {call.hidden} is not a multiple of the NVFP4 block "
                                     f"{quant.NVFP4_BLOCK}")
        return over_cap(call, dispatch.HARD_MAX_FUSED_BYTES, "the largest FlashInfer workspace arfusion creates")

    def facts(self, call: Call) -> "DeviceFacts":
        return device_facts(runtime.device_index(call.device))

    def limits(self, call: Call) -> dispatch.Limits | None:
        facts = device_facts(runtime.device_index(call.device))
        return dispatch.limits_for(facts.sm[0], facts.name, call.world_size, call.hidden, call.dtype)

    def default_max_bytes(self, call: Call) -> int | None:
        limits = self.limits(call)
        return 0 if limits is None else limits.max_fused_bytes

    def why_not(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        reason = self.capabilities.why_not(call) or self.unavailable(call.device) or self.shape_check(call)
        if reason:
            return reason
        sm = device_facts(runtime.device_index(call.device)).sm[0]
        problem = dispatch.quant_problem(call.form.quant, sm, torch.version.cuda)
        if problem:
            return Reason(Why.GPU_ARCH, problem)
        if max_bytes_override is not None:
            cap, source = max_bytes_override, "the configured max_size_mb"
        else:
            limits = self.limits(call)
            if limits is None:
                return Reason(Why.NO_TABLE, f"no dispatch entry for SM {sm}x, world size {call.world_size}, "
                                            f"{call.dtype} (run `arfusion tune`)")
            cap, source = limits.max_fused_bytes, limits.source
            # Sites that pay one more kernel or pass than the table's plain site have lower caps.
            for applies, lower_cap, name in (
                    (call.form.quant == "fp8_group", dispatch.group_quant_cap, "per-group FP8 cap (GROUP_QUANT_MAX_MIB)"),
                    (call.input_scaled, dispatch.scaled_input_cap, "scaled-input cap (SCALED_INPUT_MAX_MIB)")):
                lower = lower_cap(sm, call.world_size) if applies else None
                if lower is not None and lower < cap:
                    cap, source = lower, name
        return over_cap(call, cap, source)

    def use_oneshot(self, call: Call) -> bool:
        if call.oneshot is not None:  # tuning and benchmarks force a kernel (two-shot needs T > world)
            return call.oneshot or call.tokens <= call.world_size
        limits = self.limits(call) or dispatch.Limits(0, 0, "none")
        return dispatch.use_oneshot(limits, call.tokens, call.nbytes, call.world_size)

    def fingerprint(self) -> str:
        return f"flashinfer {_flashinfer_version()} table {dispatch.table_hash()}"

    # ------------------------------------------------------------- run time

    def prepare(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        state = self._groups.current(call.group_name)
        # Sized for the largest input this configuration fuses (the user's cap, else the table's),
        # so one workspace serves every shape and every captured graph.
        cap = max_bytes_override if max_bytes_override is not None else self.default_max_bytes(call)
        reason = self._ready_workspace(state, call, cap)
        if reason:
            return Reason(Why.RUNTIME, reason)
        if not call.form.residual and call.dtype not in state.zeros and not runtime.capturing():
            state.zeros[call.dtype] = outside_graph_pools(
                call.device, lambda: torch.zeros(state.capacity_elems, dtype=call.dtype, device=call.device))
        return None

    def _ready_workspace(self, state: _GroupState, call: Call, cap: int | None) -> str | None:
        """The group's workspace, holding at least `call` (made for max(cap, call) if it must be
        made: collectively, outside graph pools, never during capture), or why there is none."""
        if state.failed:
            return state.failed
        if self._fits(state, call):
            return None
        if runtime.capturing():
            return ("no large enough FlashInfer workspace yet and workspaces are never created "
                    "during CUDA-graph capture: run the model once eagerly first")
        wanted = min(max(cap or 0, call.nbytes), dispatch.HARD_MAX_FUSED_BYTES)
        return outside_graph_pools(call.device, lambda: self._create_workspace(state, call, wanted))

    def _fits(self, state: _GroupState, call: Call) -> bool:
        ws = state.workspace
        return (ws is not None and call.tokens * call.hidden <= state.capacity_elems
                and ws.is_buffer_size_sufficient(call.world_size, call.tokens, call.hidden, call.dtype))

    def _create_workspace(self, state: _GroupState, call: Call, wanted_bytes: int) -> str | None:
        """Collective over the call's group; every rank returns the same verdict."""
        started = time.perf_counter()
        itemsize = call.dtype.itemsize
        max_tokens = max(1, math.ceil(wanted_bytes / (call.hidden * itemsize)))
        workspace, error = self._new_workspace(call, max_tokens)
        if error:
            state.failed = error
            return error
        if state.workspace is not None:
            state.retired.append(state.workspace)
        state.workspace, state.capacity_elems = workspace, max_tokens * call.hidden
        state.zeros.clear()
        log.info("arfusion: FlashInfer workspace for group %s (world %d): up to %d tokens x %d "
                 "(%.1f MiB per rank input) ready in %.1fs", call.group_name, call.world_size, max_tokens,
                 call.hidden, max_tokens * call.hidden * itemsize / dispatch.MiB,
                 time.perf_counter() - started)
        return None

    def _new_workspace(self, call: Call, max_tokens: int) -> tuple[Any, str | None]:
        """(workspace, None) or (None, why not): collective over the call's group, and every rank
        returns the same verdict (readiness first, then creation, then its success)."""
        group = dist.distributed_c10d._resolve_process_group(call.group_name)
        comm_dev = comm_device(group, call.device)
        local_problem = _build_kernels() or _memory_problem(
            call.device, dispatch.workspace_bytes_bound(group.size(), max_tokens, call.hidden))
        facts = [] if local_problem else _rank_facts(runtime.device_index(call.device))
        verdict = exchange.group_verdict(local_problem, facts, group, comm_dev, _local_gpus())
        if not all_ranks_agree(verdict is None, group, comm_dev):
            return None, verdict or "another rank of the group cannot use FlashInfer (see its log)"

        workspace, error = None, None
        try:
            fic = importlib.import_module("flashinfer.comm")
            with exchange.unicast_symmetric_memory():
                workspace = fic.create_allreduce_fusion_workspace(
                    backend=FI_BACKEND, world_size=group.size(), rank=group.rank(),
                    max_token_num=max_tokens, hidden_dim=call.hidden, dtype=call.dtype, group=group,
                    comm_backend=exchange.exchange_backend(group, call.group_name))
        except Exception as e:  # reported below, after every rank has said how it went
            error = f"{type(e).__name__}: {e}"
        if not all_ranks_agree(error is None, group, comm_dev):
            if workspace is not None:
                workspace.destroy()
            return None, f"FlashInfer workspace creation failed: {error or 'on another rank'}"
        return workspace, None

    def run(self, call, x, residual, weight, eps, quant_scale):
        fic = kernel.comm_module()
        site, state = call.form, self._groups[call.group_name]
        x2 = flatten_tokens(x)
        if residual is not None:
            residual_in = flatten_tokens(residual)
        elif call.dtype in state.zeros:
            residual_in = state.zeros[call.dtype][: x2.numel()].view_as(x2)
        else:  # first use of a residual-free site inside a capture: a memset in the graph
            residual_in = torch.zeros_like(x2)
        in_kernel = site.quant in IN_KERNEL_QUANTS
        # Everything preallocated (CUDA graphs); the norm is written only when someone reads it.
        produced = {"residual": torch.empty_like(x2),
                    "norm": torch.empty_like(x2) if site.emit_norm or not in_kernel else None}
        quant_out = scale_out = scale_factor = layout_code = None
        if site.quant in ("fp8_static", "fp8_dynamic"):
            quant_out = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device)
        if site.quant == "fp8_dynamic":
            scale_out = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x2.device)
        if site.quant == "fp8_static":
            # Read on the GPU in place, so a captured graph follows updates to the scale; a
            # Python float would be copied to the device on every call.
            scale_factor = quant_scale.to(device=x2.device, dtype=torch.float32).reshape(1)
        if site.quant == "nvfp4":
            tokens, hidden = x2.shape
            quant_out = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=x2.device)
            scale_out = torch.empty(tokens, hidden // quant.NVFP4_BLOCK, dtype=torch.float8_e4m3fn,
                                    device=x2.device)
            scale_factor, layout_code = kernel.fp4_scale_factor(quant_scale, x2.device), kernel.NVFP4_LINEAR_LAYOUT
        self._launch(fic, call, x2, getattr(fic.AllReduceFusionPattern, QUANT_KERNELS[site.quant][site.emit_norm]),
                     residual_out=produced["residual"], norm_out=produced["norm"], residual_in=residual_in,
                     quant_out=quant_out, scale_out=scale_out, scale_factor=scale_factor, layout_code=layout_code,
                     rms_gamma=weight.contiguous(), rms_eps=float(eps),
                     weight_bias=1.0 if site.norm == "gemma_rms" else 0.0)
        if in_kernel:
            produced.update(quant=quant_out, scale=scale_out)
        elif site.quant == "fp8_group":
            produced.update(_group_quant(produced["norm"]))
        return [produced[name] for name in site.outputs()]

    # ------------------------------------------------------------- plain all-reduce

    def plain_why_not(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        """FlashInfer's kAllReduce (one-shot, on the group's workspace) where the plain table says
        it beats NCCL (`dispatch.plain_max_bytes`); tokens None: decided at run time."""
        reason = self.capabilities.why_not_plain(call) or self.unavailable(call.device)
        if reason:
            return reason
        if call.hidden % 8:
            return Reason(Why.SHAPE, f"last dim {call.hidden} is not a multiple of 8")
        if max_bytes_override is not None:
            cap, source = max_bytes_override, "the configured plain_max_size_mb"
        else:
            facts = device_facts(runtime.device_index(call.device))
            cap, source = dispatch.plain_max_bytes(facts.sm[0], facts.name, call.world_size, call.hidden, call.dtype)
            if cap is None:
                return Reason(Why.NO_TABLE, source)
        return over_cap(call, min(cap, dispatch.HARD_MAX_FUSED_BYTES), source)

    def prepare_plain(self, call: Call) -> Reason | None:
        """The group's workspace, the same one the fused sites use (a plain call on it keeps every
        rank's sequence of calls the same), grown if this call needs more."""
        reason = self._ready_workspace(self._groups.current(call.group_name), call, self.default_max_bytes(call))
        return Reason(Why.RUNTIME, reason) if reason else None

    def all_reduce(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        fic = kernel.comm_module()
        out = torch.empty_like(x)
        self._launch(fic, call, x, fic.AllReduceFusionPattern.kAllReduce, allreduce_out=out)
        return out

    def bind(self, call: Call):
        """The kernel's call worked out once (kernel.bound); quantized and scaled sites decline first."""
        if call.form != PLAIN and (call.form.quant != "none" or call.input_scaled):
            return None
        fic, state = kernel.comm_module(), self._groups[call.group_name]
        if call.form == PLAIN:
            return kernel.bound(fic, state, fic.AllReduceFusionPattern.kAllReduce, call.tokens, call.hidden, **self._knobs(call))
        zeros = None if call.form.residual else state.zeros.get(call.dtype)
        if zeros is None and not call.form.residual:
            return None
        return kernel.bound(fic, state, fic.AllReduceFusionPattern.kARResidualRMSNorm, call.tokens, call.hidden,
                            None if zeros is None else zeros[: call.tokens * call.hidden],
                            weight_bias=1.0 if call.form.norm == "gemma_rms" else 0.0, **self._knobs(call))

    def _knobs(self, call: Call) -> dict:
        return dict(launch_with_pdl=self.launch_with_pdl, trigger_completion_at_end=True, fp32_acc=self.fp32_acc,
                    use_oneshot=self.use_oneshot(call))

    def _launch(self, fic, call: Call, x2: torch.Tensor, pattern, **tensors) -> None:
        kernel.launch(fic, self._groups[call.group_name].workspace, x2, pattern, tensors, **self._knobs(call))

    def workspace(self, group_name: str):
        """The live workspace of a group, or None (benchmarks use it to call FlashInfer directly)."""
        state = self._groups.get(group_name)
        return None if state is None else state.workspace

    def close(self) -> None:
        """Free every workspace. Called at exit; call it earlier (on every rank, after the last
        fused call) to free the memory sooner."""
        held, release = [s for s in self._groups.everything() if s.workspace is not None or s.finalize is not None], None
        try:
            if held:
                torch.cuda.synchronize()
                release = importlib.import_module("flashinfer.comm.trtllm_ar").trtllm_destroy_ipc_workspace_for_all_reduce_fusion
        except Exception:  # interpreter shutdown may have torn CUDA or the module down already
            pass
        for state in held:
            for ws in [state.workspace, *state.retired, *(state.finalize.pair if state.finalize else ())]:
                if ws is None:
                    continue
                try:
                    if release is not None:
                        release(ws.ipc_handles)  # drops FlashInfer's own reference to the memory
                    ws.destroy()
                except Exception:
                    pass
            state.workspace = None  # what kernel.bound calls check
        self._groups.clear()
        self._codecs.clear()


def _group_quant(normed: torch.Tensor) -> dict[str, torch.Tensor]:
    """arfusion.quant.fp8_group as one Inductor kernel after FlashInfer's norm."""
    return runtime.compiled(quant.fp8_group)(normed)


# ----------------------------------------------------------------- environment checks


@functools.lru_cache(maxsize=None)
def _environment_problem(index: int) -> str | None:
    """Why this GPU cannot run the kernel, from facts that are equal across a node's ranks."""
    if importlib.util.find_spec("flashinfer") is None:
        return "FlashInfer is not installed (pip install flashinfer-python==0.7.2.post1)"
    facts = device_facts(index)
    if facts.sm[0] not in dispatch.SUPPORTED_SM_MAJORS:
        return f"{facts.name} (SM {facts.sm[0]}.{facts.sm[1]}) is not supported"
    return None


def _build_kernels() -> str | None:
    """Import FlashInfer and build/load its comm kernels (JIT; minutes on a cold cache)."""
    try:
        importlib.import_module("flashinfer.comm")
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    except Exception as e:
        return f"FlashInfer kernels unavailable: {type(e).__name__}: {e}"
    return None


def _free_device_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _memory_problem(device: torch.device, needed: int) -> str | None:
    free = _free_device_bytes(device)
    if free is not None and free < needed:
        return (f"{free / dispatch.MiB:.0f} MiB free on this rank's GPU, the workspace may need up to "
                f"{needed / dispatch.MiB:.0f} MiB")
    return None


def _local_gpus() -> dict[int, int]:
    """This process's GPUs: hash of the uuid -> device index."""
    return {hash63(device_facts(i).uuid): i for i in range(torch.cuda.device_count())}


def _rank_facts(index: int) -> list[int]:
    facts = device_facts(index)
    return [hash63(socket.gethostname()), hash63(facts.uuid), facts.sm[0] * 10 + facts.sm[1],
            hash63(dispatch.table_hash())]
