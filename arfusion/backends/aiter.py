"""aiter backend: AMD Instinct GPUs (gfx942 = MI300 series, gfx950 = MI350 series).

A call runs the first stage of this chain that is available, and each stage it skips is
logged once with the reason:

1. one kernel: all-reduce + residual add + RMSNorm + FP8 quant (per-group or per-token);
2. one kernel for all-reduce + residual add + RMSNorm, then arfusion's reference quant;
3. unfused: aiter's plain custom all-reduce (or torch's) and the reference math.

aiter's `custom_*` methods return None when the custom all-reduce is disabled or the input
does not fit; that counts as "stage unavailable", as does an exception. Every choice reads
only values that are the same on every rank (shapes, dtypes, world size, arch, aiter
version, environment), so all ranks of a group take the same path.

Opt-in quantized all-reduce (`PassConfig(quantized_allreduce=...)`): aiter's quick all-reduce
("quickreduce": `aiter.init_custom_qr` / `qr_all_reduce`, FP8, INT6 or INT4 payload), one per
group, set up collectively on the first eager call that wants it; the fused op then runs the
compiled add + RMSNorm (+ quant) after it. See "quick all-reduce" below.

aiter is never imported when this module is imported. `unavailable()` imports it only
after the ROCm build, the package and the GPU arch have been checked: on a non-ROCm torch,
`import aiter` raises RuntimeError and leaves half-loaded modules behind.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import quant, reference, runtime
from ..core import QUANT_FORMS, Call, flatten_tokens
from ..runtime import PerGroup, group_is_live, hash63, log_once, outside_graph_pools
# A module name of its own, so tests can stand in for the collective.
from ..runtime import all_ranks_agree as _all_agree
from .base import Backend, Capabilities

log = logging.getLogger("arfusion")

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class AiterLimits:
    """Every number the aiter backend decides by. Byte limits are per-rank input bytes and
    inclusive. Sources: FIELD_NOTES = ../shared/notes/FIELD_NOTES.md; aiter files are
    ROCm/aiter aiter/dist/device_communicators/custom_all_reduce.py (CA) and
    communicator_cuda.py (COMM) at main 03644e5, and the amd-aiter 0.1.7.post2.dev18 wheel."""

    # FIELD_NOTES §4 "Archs": the archs aiter ships kernels for; gfx1250 has its own path.
    archs: tuple[str, ...] = ("gfx942", "gfx950")
    # FIELD_NOTES §4 "Archs" (aiter.utility.dtypes.fp8): e4m3fnuz (max 240) on gfx942,
    # e4m3fn (max 448) on gfx950.
    fp8_dtypes: dict[str, torch.dtype] = field(default_factory=lambda: {
        "gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn})
    # FIELD_NOTES §4: the 0.1.7 fused kernel takes world sizes {2, 4, 8}; COMM also excludes 6
    # (SGLang#21986 keeps "tp != 6"), though CA lists 6 as a plain all-reduce size.
    world_sizes: tuple[int, ...] = (2, 4, 8)
    # COMM fused_allreduce_rmsnorm: n <= 16384 (also SGLang#21986).
    max_hidden: int = 16384
    # CA: PACK_SIZE = 16 // element_size; hidden must be whole packs (aiter#2453 via SGLang#21986).
    pack_bytes: int = 16
    # SGLang#21986: total bytes <= 8 * 1024 * 8192 (64 MiB), inclusive, matching CA's
    # `inp_size <= max_size` cutoff (default AITER_CUSTOM_AR_MAX_SIZE = 8192 * 8192).
    max_bytes: int = 64 * MIB
    # CA's registered input buffer. vLLM _aiter_ops.py uses 8192*1024*8*2 and takes half as
    # the usable size (aiter v0.1.10.post3 accepts <= max_size / 2), so 2 x max_bytes fits all
    # versions; aiter main's default (1 GiB, ~3 GiB per rank in total) is far more than needed.
    registered_buffer_bytes: int = 2 * 64 * MIB
    # FIELD_NOTES §4 / SGLang#21986: the 1-stage kernel runs one block per token, kMaxBlocks = 80.
    one_stage_max_tokens: int = 80
    # FIELD_NOTES §4 and vLLM _aiter_ops.py: 1-stage needs hidden / pack <= 1024 (bf16 H <= 8192).
    one_stage_max_packs: int = 1024
    # vLLM _aiter_ops.py 1-stage size rule: ws=2 any size (the token limit bounds it), ws=4
    # < 256 KiB, ws=8 < 128 KiB (vLLM uses "<"; every byte limit here is inclusive, one rule).
    one_stage_max_bytes: dict[int, int | None] = field(default_factory=lambda: {
        2: None, 4: 256 * KIB, 8: 128 * KIB})
    # FIELD_NOTES §4: vLLM treats aiter without `_pool` (an IPCBufferPool, aiter >= 0.1.12) as
    # old: 1-stage only for these hidden sizes ...
    legacy_one_stage_hidden: tuple[int, ...] = (512, 1024, 2048, 4096)
    # ... and the 0.1.7 fused 2-stage kernel needs 1024 <= H * elem <= 32768, a multiple of 1024.
    legacy_row_bytes: tuple[int, int, int] = (1024, 32768, 1024)  # (min, max, multiple)
    # SGLang#24651: the one-kernel AR+RMSNorm+quant dispatch is gated to gfx95x.
    one_kernel_quant_archs: tuple[str, ...] = ("gfx950",)
    # SGLang#24651 / COMM fused_allreduce_rmsnorm_quant_per_group: group 128, fp32 scales [T, H/128].
    quant_group_size: int = 128
    # COMM fused_allreduce_rmsnorm_quant: the per-token kernel only for these hidden sizes
    # (7168 bf16/fp16 only; arfusion sends nothing else) and <= 4096 KiB; others go to stage 2.
    per_token_quant_hidden: tuple[int, ...] = (512, 1024, 2048, 4096, 7168)
    per_token_quant_max_bytes: int = 4 * MIB

    # Quick all-reduce (QR = aiter/dist/device_communicators/quick_all_reduce.py, QuickAllReduce,
    # and csrc/kernels/quick_all_reduce.cu, in the 0.1.7.post2.dev18 wheel and ROCm/aiter main).
    # QR _SUPPORTED_DTYPES; the kernel throws on anything else.
    quick_reduce_dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    # QR _SUPPORTED_WORLD_SIZES; init_custom_qr throws for > 8, 6 and odd sizes.
    quick_reduce_world_sizes: tuple[int, ...] = (2, 4, 8)
    # QR _should_hip: input bytes % 16 == 0 (main's qr_all_reduce throws otherwise).
    quick_reduce_align_bytes: int = 16
    # qr_max_size(): INT32_MAX + 1 = 2 GiB, the largest message (inclusive, _should_hip `<=`) when
    # init_custom_qr gets no qr_max_size. The buffer it allocates per rank is twice that (4 GiB,
    # uncached); QUICK_REDUCE_MAX_SIZE_ENV (aiter's own variable, MiB) makes both smaller.
    quick_reduce_default_max_bytes: int = 2048 * MIB
    # QR _QR_MIN_SIZE (0.1.7), MiB per rank from which aiter itself uses the quick all-reduce
    # (inclusive, `>=`), by (kernel dtype, world size); the kernel dtype is fp16 for bf16 input
    # when cast_bf2half is on (QUICK_REDUCE_CAST_ENV, default on). aiter says these are "based on
    # kernel tests": its crossover against its own custom all-reduce. arfusion uses them as its
    # crossover UNMEASURED against its fused all-reduce + RMSNorm kernel (no AMD GPU here).
    # ROCm/aiter main (0c3e72b) has the same numbers except (fp16, 8) int4: 8 MiB there.
    quick_reduce_min_mib: dict[tuple[torch.dtype, int], dict[str, int]] = field(default_factory=lambda: {
        (torch.float16, 2): {"fp8": 2, "int6": 2, "int4": 1},
        (torch.float16, 4): {"fp8": 16, "int6": 4, "int4": 2},
        (torch.float16, 8): {"fp8": 4, "int6": 4, "int4": 2},
        (torch.bfloat16, 2): {"fp8": 8, "int6": 8, "int4": 8},
        (torch.bfloat16, 4): {"fp8": 64, "int6": 64, "int4": 16},
        (torch.bfloat16, 8): {"fp8": 2048, "int6": 2048, "int4": 2048},
    })


LIMITS = AiterLimits()

DISABLE_QUANT_ENV = "ARFUSION_DISABLE_AITER_QUANT"
CUSTOM_AR_MODULE = "aiter.dist.device_communicators.custom_all_reduce"
QUICK_REDUCE_MODULE = "aiter.dist.device_communicators.quick_all_reduce"
# aiter's own environment variables for its QuickAllReduce, read with the same defaults.
QUICK_REDUCE_CAST_ENV = "AITER_QUICK_REDUCE_CAST_BF16_TO_FP16"  # int, default 1: bf16 runs fp16 kernels
QUICK_REDUCE_MAX_SIZE_ENV = "AITER_QUICK_REDUCE_MAX_SIZE_BYTES_MB"  # int MiB, <= 0 or unset: 2 GiB
# arfusion level -> QuickReduceRegime member. aiter has no INT8 codec: its level 1 is FP8.
QUICK_REDUCE_REGIMES = {"fp8": "FP8", "int6": "INT6", "int4": "INT4"}
# What arfusion calls on the `aiter` module (aiter/ops/quick_all_reduce.py, star-imported there).
QUICK_REDUCE_OPS = ("init_custom_qr", "qr_destroy", "qr_all_reduce", "qr_get_handle", "qr_open_handles",
                    "qr_max_size")

# Stage names, as logged.
FUSED_QUANT = "one-kernel all-reduce+RMSNorm+quant"
FUSED_NORM = "one-kernel all-reduce+RMSNorm"
UNFUSED = "unfused"

# Quant forms with an aiter one-kernel path.
_ONE_KERNEL_QUANTS = ("fp8_group", "fp8_dynamic")


# ---------------------------------------------------------------- what the installed aiter offers


@dataclass(frozen=True)
class AiterApi:
    """The installed aiter's CustomAllreduce, read once from its method signatures.

    Return order of `custom_fused_ar_rms` (it changed without a rename): in amd-aiter
    0.1.7.post2.dev18 the method has no `use_1stage` and returns (residual_out, out); from
    the commit that added `use_1stage` (seen at ROCm/aiter 86a98ee) through main (03644e5) it
    returns (out, residual_out). So `use_1stage` in the signature means "norm first".
    """

    version: str
    choose_stage: bool  # custom_fused_ar_rms takes use_1stage
    norm_first: bool  # custom_fused_ar_rms returns (out, residual_out)
    gemma_norm: bool  # custom_fused_ar_rms takes gemma_norm
    per_token_quant: bool  # custom_fused_ar_rms_quant exists
    per_token_gemma: bool
    per_group_quant: bool  # custom_fused_ar_rms_per_group_quant exists (aiter#2823)
    per_group_norm_out: bool  # ... and takes emit_bf16
    flexible_hidden: bool  # any hidden of whole packs (IPCBufferPool-era aiter, see LIMITS)
    fp8: torch.dtype | None = None  # aiter.utility.dtypes.fp8, when readable


def _params(cls: Any, method: str) -> frozenset[str]:
    fn = getattr(cls, method, None)
    if fn is None:
        return frozenset()
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def describe_api(custom_ar_module: Any, version: str, fp8: torch.dtype | None = None) -> AiterApi:
    cls = custom_ar_module.CustomAllreduce
    fused = _params(cls, "custom_fused_ar_rms")
    per_token = _params(cls, "custom_fused_ar_rms_quant")
    per_group = _params(cls, "custom_fused_ar_rms_per_group_quant")
    return AiterApi(
        version=version,
        choose_stage="use_1stage" in fused,
        norm_first="use_1stage" in fused,
        gemma_norm="gemma_norm" in fused,
        per_token_quant=bool(per_token),
        per_token_gemma="gemma_norm" in per_token,
        per_group_quant=bool(per_group),
        per_group_norm_out="emit_bf16" in per_group,
        flexible_hidden=hasattr(custom_ar_module, "IPCBufferPool"),
        fp8=fp8,
    )


# ---------------------------------------------------------------- detection


@dataclass(frozen=True)
class Detected:
    arch: str  # one of LIMITS.archs
    api: AiterApi
    custom_ar: Any  # the aiter module holding CustomAllreduce


def _gpu_arch(device_index: int) -> str:
    return getattr(torch.cuda.get_device_properties(device_index), "gcnArchName", "") or ""


def _aiter_version(aiter_module: Any) -> str:
    for dist_name in ("amd-aiter", "aiter"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return str(getattr(aiter_module, "__version__", "unknown"))


def _aiter_fp8() -> torch.dtype | None:
    try:
        return importlib.import_module("aiter.utility.dtypes").fp8
    except Exception:  # only a cross-check; LIMITS.fp8_dtypes is the rule
        return None


@functools.cache
def detect(device_index: int) -> Detected | str:
    """Detected, or why aiter cannot run here. Cached: find_spec is not compile-friendly."""
    if torch.version.hip is None:
        return "torch is not a ROCm build (torch.version.hip is None)"
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError) as e:
        return f"aiter package lookup failed: {e}"
    if spec is None:
        return "aiter is not installed"
    try:
        arch = _gpu_arch(device_index)
    except Exception as e:
        return f"cannot read the GPU arch: {type(e).__name__}: {e}"
    family = next((a for a in LIMITS.archs if arch.startswith(a)), None)
    if family is None:
        return f"GPU arch {arch or 'unknown'!r} is not one of {list(LIMITS.archs)}"
    try:
        aiter_module = importlib.import_module("aiter")
        custom_ar = importlib.import_module(CUSTOM_AR_MODULE)
    except Exception as e:  # a broken install raises anything (RuntimeError on non-ROCm)
        return f"import aiter failed: {type(e).__name__}: {e}"
    api = describe_api(custom_ar, _aiter_version(aiter_module), _aiter_fp8())
    return Detected(arch=family, api=api, custom_ar=custom_ar)


def quant_dtype(arch: str) -> torch.dtype:
    return LIMITS.fp8_dtypes[arch]


def quant_disabled_by_env() -> bool:
    return os.environ.get(DISABLE_QUANT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


# ---------------------------------------------------------------- pure decisions


def _pack(dtype: torch.dtype) -> int:
    return LIMITS.pack_bytes // torch.empty((), dtype=dtype).element_size()


def legacy_shape_problem(hidden: int, dtype: torch.dtype) -> str | None:
    """Old aiter (no IPCBufferPool) computes nothing, silently, outside these row sizes."""
    low, high, multiple = LIMITS.legacy_row_bytes
    row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    if not (low <= row_bytes <= high and row_bytes % multiple == 0):
        return (f"this aiter's fused kernel needs {low} <= hidden bytes <= {high} in steps of "
                f"{multiple}, got {row_bytes}")
    return None


def use_one_stage(call: Call, api: AiterApi) -> bool:
    """1-stage (one block per token, reads all peers) for small inputs, else 2-stage."""
    cap = LIMITS.one_stage_max_bytes.get(call.world_size)
    return (call.tokens <= LIMITS.one_stage_max_tokens
            and call.hidden // _pack(call.dtype) <= LIMITS.one_stage_max_packs
            and (cap is None or call.nbytes <= cap)
            and (api.flexible_hidden or call.hidden in LIMITS.legacy_one_stage_hidden))


def one_kernel_quant_problem(call: Call, found: Detected, env_opt_out: bool) -> str | None:
    """Why stage 1 (one kernel including the quant) cannot take this call, or None."""
    site, api = call.site, found.api
    if env_opt_out:
        return f"{DISABLE_QUANT_ENV} is set"
    if site.quant not in _ONE_KERNEL_QUANTS:
        return f"aiter has no one-kernel {site.quant} path"
    if found.arch not in LIMITS.one_kernel_quant_archs:
        return f"one-kernel quant dispatch is limited to {list(LIMITS.one_kernel_quant_archs)}"
    if api.fp8 is not None and api.fp8 != quant_dtype(found.arch):
        return f"aiter's fp8 dtype {api.fp8} is not {quant_dtype(found.arch)} for {found.arch}"
    reason = (_per_group_problem(call, api) if site.quant == "fp8_group"
              else _per_token_problem(call, api))
    return reason or _reference_layout_problem(call, quant_dtype(found.arch))


def _per_group_problem(call: Call, api: AiterApi) -> str | None:
    if not api.per_group_quant:
        return "this aiter has no per-group quant kernel"
    if call.site.norm == "gemma_rms":
        return "the per-group quant kernel has no gemma_norm"
    if call.site.emit_norm and not api.per_group_norm_out:
        return "this aiter's per-group quant kernel cannot also emit the norm (emit_bf16)"
    if call.hidden % LIMITS.quant_group_size:
        return f"hidden {call.hidden} is not a multiple of {LIMITS.quant_group_size}"
    return None


def _per_token_problem(call: Call, api: AiterApi) -> str | None:
    if not api.per_token_quant:
        return "this aiter has no per-token quant kernel"
    if call.site.norm == "gemma_rms" and not api.per_token_gemma:
        return "this aiter's per-token quant kernel has no gemma_norm"
    if call.site.emit_norm:
        return "aiter's per-token quant kernel does not emit the norm (its communicator refuses emit_bf16)"
    if call.hidden not in LIMITS.per_token_quant_hidden:
        return f"the per-token quant kernel takes hidden in {list(LIMITS.per_token_quant_hidden)}"
    if call.nbytes > LIMITS.per_token_quant_max_bytes:
        return f"{call.nbytes} bytes > {LIMITS.per_token_quant_max_bytes} for the per-token quant kernel"
    return None


def _kernel_quant_layout(form: str, tokens: int, hidden: int, fp8: torch.dtype):
    """(dtype, shape, stride) of aiter's quant and scale outputs."""
    width = hidden // LIMITS.quant_group_size if form == "fp8_group" else 1
    return ((fp8, (tokens, hidden), (hidden, 1)), (torch.float32, (tokens, width), (width, 1)))


@functools.lru_cache(maxsize=256)
def _reference_layout(quantize, form: str, dtype: torch.dtype, hidden: int):
    probe = torch.empty((2, hidden), dtype=dtype, device="meta")
    out = quantize(probe, form, None)
    return tuple((t.dtype, tuple(t.shape), tuple(t.stride())) for t in (out["quant"], out["scale"]))


def _reference_layout_problem(call: Call, fp8: torch.dtype) -> str | None:
    """The fused op promised the reference quant's outputs (its fake impl), so the kernel's
    quant and scale must have exactly their dtype, shape and layout."""
    try:
        expected = _reference_layout(quant.quantize, call.site.quant, call.dtype, call.hidden)
    except Exception as e:
        return f"reference quant layout unknown ({type(e).__name__}: {e})"
    produced = _kernel_quant_layout(call.site.quant, 2, call.hidden, fp8)
    # The FP8 dtype follows the GPU arch on both sides (quant.fp8_dtype and LIMITS.fp8_dtypes);
    # a meta-device probe cannot tell gfx942 from the rest, so compare the quant's layout only.
    expected = ((fp8, *expected[0][1:]), expected[1])
    if expected != produced:
        return f"aiter's quant outputs {produced} differ from the reference's {expected}"
    return None


def plan(call: Call, found: Detected, env_opt_out: bool) -> tuple[list[str], list[str]]:
    """(stages to try in order, ending with UNFUSED; reasons for stages left out)."""
    stages, skipped = [], []
    if call.site.quant != "none":
        reason = one_kernel_quant_problem(call, found, env_opt_out)
        if reason:
            skipped.append(f"{FUSED_QUANT} skipped: {reason}")
        else:
            stages.append(FUSED_QUANT)
    stages += [FUSED_NORM, UNFUSED]
    return stages, skipped


# ---------------------------------------------------------------- set-up on the matched TP group

_gloo_groups: dict[tuple[int, ...], Any] = {}


def _resolve_group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def _group_or_none(group_name: str):
    """What the name resolves to now, None for no group (looked up through `_resolve_group` at
    each call, so tests can stand in for it)."""
    try:
        return _resolve_group(group_name)
    except RuntimeError:
        return None


def gloo_twin(group):
    """A gloo group of the same ranks: aiter exchanges IPC handles over a non-NCCL group.

    Created once per rank set, by the member ranks only (use_local_synchronization): other
    TP groups' ranks are at their own first call, with their own ranks, at the same time.
    Again after destroy_process_group, which destroys the twin with everything else.
    """
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _gloo_groups or not group_is_live(_gloo_groups[ranks]):
        _gloo_groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _gloo_groups[ranks]


def create_communicator(custom_ar: Any, group_name: str, device: torch.device) -> Any:
    """aiter's CustomAllreduce for this group, or a string saying why there is none."""
    try:
        group = gloo_twin(_resolve_group(group_name))
        comm = custom_ar.CustomAllreduce(group, device, max_size=LIMITS.registered_buffer_bytes)
    except Exception as e:
        return f"aiter custom all-reduce set-up failed: {type(e).__name__}: {e}"
    if comm.disabled:
        return "aiter disabled its custom all-reduce for this group (multi-node or unsupported size)"
    return comm


# ---------------------------------------------------------------- quick all-reduce (quantized, opt-in)


@dataclass(frozen=True)
class QuickReduceApi:
    """The installed aiter's quick all-reduce, read once.

    Handle exchange (IPC handles of each rank's buffer, over a non-NCCL group):
    * "helper": ROCm/aiter main has `qr_exchange_handles(ptr, world_size, group)` in the
      communicator module (`qr_get_handle(fa, out_ptr)` / `qr_open_handles(fa, handle_ptrs)`
      take raw host pointers there), and arfusion calls it;
    * "tensors": amd-aiter 0.1.7 has `qr_get_handle(fa) -> Tensor` and
      `qr_open_handles(fa, handles: list[Tensor])` with `dist.all_gather_object` in between.
    """

    ops: Any  # the `aiter` module: init_custom_qr, qr_all_reduce, ...
    module: Any  # aiter.dist.device_communicators.quick_all_reduce
    levels: dict  # arfusion level -> QuickReduceRegime value, read by member name
    exchange: str  # "helper" or "tensors"


def _positional_params(fn: Any) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


@functools.cache
def quick_reduce_api() -> QuickReduceApi | str:
    """The quick all-reduce of the installed aiter, or why there is none. Call only after
    `detect` accepted the GPU (that is what makes importing aiter safe)."""
    try:
        ops = importlib.import_module("aiter")
    except Exception as e:  # a broken install raises anything
        return f"import aiter failed: {type(e).__name__}: {e}"
    missing = [name for name in QUICK_REDUCE_OPS if not callable(getattr(ops, name, None))]
    if missing:
        return f"this aiter has no quick all-reduce ({', '.join(missing)} missing)"
    try:
        module = importlib.import_module(QUICK_REDUCE_MODULE)
    except Exception as e:
        return f"aiter's quick all-reduce module did not import: {type(e).__name__}: {e}"
    regime = getattr(module, "QuickReduceRegime", None)
    levels = {}
    for level, member in QUICK_REDUCE_REGIMES.items():
        value = getattr(getattr(regime, "__members__", {}).get(member), "value", None)
        if isinstance(value, int) and not isinstance(value, bool):
            levels[level] = value
    if callable(getattr(module, "qr_exchange_handles", None)):
        exchange = "helper"
    elif _positional_params(ops.qr_get_handle) in (["fa"], None):
        exchange = "tensors"
    else:
        return (f"unknown quick all-reduce handle exchange: qr_get_handle takes "
                f"{_positional_params(ops.qr_get_handle)} and {QUICK_REDUCE_MODULE} has no qr_exchange_handles")
    return QuickReduceApi(ops=ops, module=module, levels=levels, exchange=exchange)


@dataclass(frozen=True)
class QuickReduceEnv:
    """aiter's own QuickAllReduce settings, from its environment variables (same on every rank)."""

    cast_bf16: bool  # qr_all_reduce's cast_bf2half: bf16 input runs the fp16 kernels
    max_bytes: int  # largest message, inclusive
    qr_max_size: int | None  # what init_custom_qr gets: None is aiter's default (2 GiB)


def quick_reduce_env() -> QuickReduceEnv | str:
    """Read like aiter's QuickAllReduce.init_quick_all_reduce does (int(), same defaults)."""
    try:
        cast = int(os.environ.get(QUICK_REDUCE_CAST_ENV, "1"))
    except ValueError:
        return f"{QUICK_REDUCE_CAST_ENV}={os.environ[QUICK_REDUCE_CAST_ENV]!r} is not an integer"
    try:
        max_mib = int(os.environ.get(QUICK_REDUCE_MAX_SIZE_ENV, "0"))
    except ValueError:
        return f"{QUICK_REDUCE_MAX_SIZE_ENV}={os.environ[QUICK_REDUCE_MAX_SIZE_ENV]!r} is not an integer"
    if max_mib > 0:
        return QuickReduceEnv(cast_bf16=bool(cast), max_bytes=max_mib * MIB, qr_max_size=max_mib * MIB)
    return QuickReduceEnv(cast_bf16=bool(cast), max_bytes=LIMITS.quick_reduce_default_max_bytes, qr_max_size=None)


def quick_reduce_kernel_dtype(dtype: torch.dtype, env: QuickReduceEnv) -> torch.dtype:
    """The dtype aiter's kernel computes in (the key of its threshold table)."""
    return torch.float16 if dtype == torch.float16 or env.cast_bf16 else dtype


@dataclass
class _QuickReduceGroup:
    """The quick all-reduce of one process group."""

    ptr: int | None = None  # aiter's DeviceComms, set up and with every peer's buffer open
    destroy: Any = None  # aiter.qr_destroy, kept so close() needs no import
    failed: str | None = None  # the same on every rank of the group; never retried


# Collectives of the set-up, over the group's gloo twin (CPU tensors). Small functions, so the
# tests can stand in for the other ranks.


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _gather_ints(values: list[int], group) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [row.tolist() for row in rows]


def _open_peer_buffers(api: QuickReduceApi, ptr: int, handle: Any, world_size: int, group) -> None:
    """The collective part of the handle exchange (every rank calls it, or none does)."""
    if api.exchange == "helper":
        api.module.qr_exchange_handles(ptr, world_size, group)
        return
    handles = [None] * world_size
    dist.all_gather_object(handles, handle, group=group)
    api.ops.qr_open_handles(ptr, handles)


def set_up_quick_reduce(state: _QuickReduceGroup, group_name: str, world_size: int) -> str | None:
    """Collective over the group (its gloo twin); every rank returns a verdict of the same kind
    (None, or a failure that all ranks record), so no rank waits in a kernel or a collective
    its peers never enter:

    1. each rank checks what it can alone (aiter's quick all-reduce, its settings) and all
       ranks compare that and their host: a group spanning nodes has no HIP IPC;
    2. init_custom_qr (allocates 2 x qr_max_size of uncached device memory; on 0.1.7 the IPC
       handle is read here too, so nothing local can fail inside step 3's collective), agreed;
    3. the handle exchange (a collective), then each rank opens its peers' buffers, agreed.

    A communicator that failed after step 2 is left allocated: aiter's qr_destroy closes the
    peers' IPC handles, which were never opened. One that completed step 3 on a rank whose
    peer failed there is freed with qr_destroy, as aiter's own close() does.
    """
    started = time.perf_counter()
    try:
        group = gloo_twin(_resolve_group(group_name))
        rank, size = _rank_and_size(group)
    except Exception as e:
        state.failed = f"aiter quick all-reduce set-up failed: {type(e).__name__}: {e}"
        return state.failed
    api, env = quick_reduce_api(), quick_reduce_env()
    local = api if isinstance(api, str) else env if isinstance(env, str) else None
    if local is None and size != world_size:
        local = f"the group's gloo twin has {size} ranks, not {world_size}"
    rows = _gather_ints([0 if local else 1, hash63(socket.gethostname())], group)
    if local or any(row[0] == 0 for row in rows):
        state.failed = local or "aiter's quick all-reduce is unavailable on another rank of the group (see its log)"
        return state.failed
    if len({row[1] for row in rows}) > 1:
        state.failed = "the group spans nodes: aiter's quick all-reduce exchanges HIP IPC handles, one node only"
        return state.failed

    ptr = handle = error = None
    try:
        ptr = api.ops.init_custom_qr(rank, size, env.qr_max_size)
        if api.exchange == "tensors":
            handle = api.ops.qr_get_handle(ptr)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if not _all_agree(error is None, group):
        state.failed = f"aiter init_custom_qr failed: {error or 'on another rank of the group'}"
        if ptr is not None:
            log_once(f"arfusion: aiter quick all-reduce of group {group_name} left allocated after a failed set-up")
        return state.failed

    try:
        _open_peer_buffers(api, ptr, handle, size, group)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if not _all_agree(error is None, group):
        state.failed = f"aiter quick all-reduce handle exchange failed: {error or 'on another rank of the group'}"
        if error is None:
            try:
                api.ops.qr_destroy(ptr)
            except Exception:
                pass
        else:
            log_once(f"arfusion: aiter quick all-reduce of group {group_name} left allocated after a failed set-up")
        return state.failed

    state.ptr, state.destroy = ptr, api.ops.qr_destroy
    log.info("arfusion: aiter quick all-reduce for group %s (world %d) ready in %.1fs (messages up to %d MiB, "
             "%s handle exchange)", group_name, size, time.perf_counter() - started, env.max_bytes // MIB,
             api.exchange)
    return None


# ---------------------------------------------------------------- the stages


@dataclass
class _Inputs:
    x: torch.Tensor  # [T, H], contiguous
    residual: torch.Tensor  # [T, H]; zeros when the site has no residual
    has_residual: bool
    weight: torch.Tensor
    eps: float
    quant_scale: torch.Tensor | None


def _run_fused_quant(comm, call: Call, inp: _Inputs, found: Detected):
    site, one_stage = call.site, use_one_stage(call, found.api)
    args = (inp.x, inp.residual, inp.weight, inp.eps)
    if site.quant == "fp8_group":
        extra = {"emit_bf16": True} if site.emit_norm else {}
        result = comm.custom_fused_ar_rms_per_group_quant(
            *args, group_size=LIMITS.quant_group_size, use_1stage=one_stage, **extra)
    else:
        extra = {"gemma_norm": True} if site.norm == "gemma_rms" else {}
        result = comm.custom_fused_ar_rms_quant(*args, use_1stage=one_stage, **extra)
    if result is None:
        return None
    produced = {"quant": result[0], "residual": result[1], "scale": result[2]}
    if site.emit_norm:
        produced["norm"] = result[3]
    return produced


def _run_fused_norm(comm, call: Call, inp: _Inputs, found: Detected):
    site, api = call.site, found.api
    extra = {"use_1stage": use_one_stage(call, api)} if api.choose_stage else {}
    if site.norm == "gemma_rms":
        extra["gemma_norm"] = True  # shape_check declined gemma sites where aiter lacks it
    result = comm.custom_fused_ar_rms(inp.x, inp.residual, inp.weight, inp.eps, **extra)
    if result is None:
        return None
    normed, residual_out = result if api.norm_first else (result[1], result[0])
    produced = {"residual": residual_out, "norm": normed}
    if site.quant != "none":
        produced.update(quant.quantize(normed, site.quant, inp.quant_scale))
    return produced


def _run_unfused(comm, call: Call, inp: _Inputs, found: Detected):
    try:
        reduced = comm.custom_all_reduce(inp.x)
    except Exception as e:
        log_once(f"arfusion: aiter plain all-reduce raised {type(e).__name__}: {e}; using torch's")
        reduced = None
    if reduced is None:
        reduced = reference.all_reduce_sum(inp.x, call.group_name)
    outs = reference.add_rms_norm(reduced, inp.residual if inp.has_residual else None, inp.weight,
                                  inp.eps, call.site, inp.quant_scale)
    return dict(zip(call.site.outputs(), outs))


_STAGES = {FUSED_QUANT: _run_fused_quant, FUSED_NORM: _run_fused_norm, UNFUSED: _run_unfused}


def _attempt(stage: str, comm, call: Call, inp: _Inputs, found: Detected):
    """(outputs by name, "") or (None, why this stage gave nothing)."""
    try:
        produced = _STAGES[stage](comm, call, inp, found)
    except Exception as e:
        return None, f"raised {type(e).__name__}: {e}"
    if produced is None:
        return None, "aiter returned None (custom all-reduce disabled, or the input does not fit it)"
    return produced, ""


# ---------------------------------------------------------------- the backend


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
        quantized_levels=frozenset(QUICK_REDUCE_REGIMES),
    ))
    # Per group, renewed when the name comes to mean another group (see PerGroup).
    _communicators: PerGroup = field(default_factory=lambda: PerGroup(lambda: None, _group_or_none), repr=False)
    _quick_reduce: PerGroup = field(default_factory=lambda: PerGroup(_QuickReduceGroup, _group_or_none), repr=False)

    def _detected(self, device: torch.device) -> Detected | str:
        if device.type != "cuda":
            return f"aiter runs on ROCm GPUs only, not on {device.type}"
        try:
            index = runtime.device_index(device)
        except Exception as e:
            return f"no current GPU: {type(e).__name__}: {e}"
        return detect(index)

    def unavailable(self, device: torch.device) -> str | None:
        found = self._detected(device)
        return found if isinstance(found, str) else None

    def shape_check(self, call: Call) -> str | None:
        found = self._detected(call.device)
        if isinstance(found, str):
            return found
        pack = _pack(call.dtype)
        if call.weight_dtype != call.dtype:
            return f"norm weight {call.weight_dtype} differs from input {call.dtype} (vllm#48324)"
        if call.world_size not in LIMITS.world_sizes:
            return f"world size {call.world_size} not in {list(LIMITS.world_sizes)}"
        if call.hidden > LIMITS.max_hidden:
            return f"hidden {call.hidden} > {LIMITS.max_hidden}"
        if call.hidden % pack:
            return f"hidden {call.hidden} is not a multiple of the pack size {pack}"
        if call.tokens == 0:
            return "no tokens"
        if call.nbytes is not None and call.nbytes > LIMITS.max_bytes:
            return f"{call.nbytes} bytes per rank > aiter's limit {LIMITS.max_bytes}"
        if call.site.norm == "gemma_rms" and not found.api.gemma_norm:
            return f"aiter {found.api.version} has no gemma_norm"
        if not found.api.flexible_hidden:
            return legacy_shape_problem(call.hidden, call.dtype)
        return None

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

    def prepare(self, call: Call, max_bytes_override: int | None = None) -> str | None:
        """Sets up the group's communicator on its first eager call (collective), or says why not."""
        comm = self._ready_communicator(call)
        return comm if isinstance(comm, str) else None

    def run(self, call, x, residual, weight, eps, quant_scale):
        comm = self._ready_communicator(call)  # prepare() made it; this also covers callers without it
        if isinstance(comm, str):
            log_once(f"arfusion: {call.site.name} ran unfused on aiter: {comm}")
            return reference.unfused(x, residual, weight, eps, call.group_name, call.site, quant_scale)
        found = self._detected(call.device)
        inp = _inputs(x, residual, weight, eps, quant_scale)
        stages, skipped = plan(call, found, quant_disabled_by_env())
        for reason in skipped:
            log_once(f"arfusion: {call.site.name}: {reason}")
        for stage in stages[:-1]:
            produced, reason = _attempt(stage, comm, call, inp, found)
            if produced is not None:
                return [produced[name] for name in call.site.outputs()]
            log_once(f"arfusion: {call.site.name}: aiter {stage} {reason}; trying the next stage")
        # The last stage is the reference math: its errors are real errors, so they propagate.
        produced = _STAGES[stages[-1]](comm, call, inp, found)
        return [produced[name] for name in call.site.outputs()]

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
                call.device, lambda: create_communicator(found.custom_ar, call.group_name, call.device))
            self._communicators[call.group_name] = comm
        return comm

    # ------------------------------------------------------------- quick all-reduce (quantized)

    def quantized_why_not(self, call: Call, level: str, min_bytes_override: int | None = None) -> str | None:
        if level not in QUICK_REDUCE_REGIMES:
            return (f"aiter's quick all-reduce has no {level} codec (its QuickReduceRegime levels are FP8, "
                    f"INT6 and INT4; level 1 is FP8, not INT8): choose one of {sorted(QUICK_REDUCE_REGIMES)}")
        return super().quantized_why_not(call, level, min_bytes_override)

    def quantized_problem(self, call: Call, level: str) -> str | None:
        """What QuickAllReduce._should_hip and the kernel accept (the arch is `detect`'s)."""
        if call.dtype not in LIMITS.quick_reduce_dtypes:
            return f"aiter's quick all-reduce takes float16 or bfloat16, not {call.dtype}"
        if call.world_size not in LIMITS.quick_reduce_world_sizes:
            return (f"aiter's quick all-reduce takes world sizes {list(LIMITS.quick_reduce_world_sizes)}, "
                    f"not {call.world_size}")
        api = quick_reduce_api()
        if isinstance(api, str):
            return api
        if level not in api.levels:
            return f"this aiter's QuickReduceRegime has no {QUICK_REDUCE_REGIMES[level]} member"
        env = quick_reduce_env()
        if isinstance(env, str):
            return env
        if call.nbytes is not None:
            if call.nbytes == 0:
                return "no tokens"
            if call.nbytes % LIMITS.quick_reduce_align_bytes:
                return (f"{call.nbytes} bytes per rank is not a multiple of {LIMITS.quick_reduce_align_bytes} "
                        "(aiter's quick all-reduce)")
            if call.nbytes > env.max_bytes:
                return f"{call.nbytes} bytes per rank > {env.max_bytes} (aiter's quick all-reduce buffer)"
        return None

    def quantized_min_bytes(self, call: Call, level: str) -> tuple[int | None, str]:
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

    def prepare_quantized(self, call: Call, level: str) -> str | None:
        """The group's quick all-reduce, set up once on an eager call (collective), or why not.
        One communicator serves every level: the level is an argument of each call."""
        state = self._quick_reduce.current(call.group_name)
        if state.failed or state.ptr is not None:
            return state.failed
        if runtime.capturing():
            return ("aiter's quick all-reduce is never set up during CUDA-graph capture: run the model "
                    "once eagerly first")
        return outside_graph_pools(
            call.device, lambda: set_up_quick_reduce(state, call.group_name, call.world_size))

    def quantized_all_reduce(self, call: Call, x: torch.Tensor, level: str) -> torch.Tensor:
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


def _inputs(x, residual, weight, eps, quant_scale) -> _Inputs:
    x2d = flatten_tokens(x)
    # No residual: aiter always adds one, so give it zeros (never empty: vllm#41972).
    res2d = flatten_tokens(residual) if residual is not None else torch.zeros_like(x2d)
    return _Inputs(x=x2d, residual=res2d, has_residual=residual is not None, weight=weight,
                   eps=eps, quant_scale=quant_scale)
