"""What the installed aiter offers, and whether it can run here at all.

aiter is never imported when this module is imported. `detect` imports it only after the ROCm
build, the package and the GPU arch have been checked: on a non-ROCm torch, `import aiter`
raises RuntimeError and leaves half-loaded modules behind (aiter/jit/core.py puts
aiter/jit/utils on sys.path first).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from .limits import CUSTOM_AR_MODULE, DISABLE_QUANT_ENV, LIMITS

log = logging.getLogger("arfusion")


@dataclass(frozen=True)
class AiterApi:
    """The installed aiter's CustomAllreduce, read once from its method signatures.

    Return order of `custom_fused_ar_rms` (it changed without a rename): in amd-aiter
    0.1.7.post2.dev18 the method has no `use_1stage` and returns (residual_out, out); from
    the commit that added `use_1stage` (seen at ROCm/aiter 86a98ee) through main (e404860) it
    returns (out, residual_out). So `use_1stage` in the signature means "norm first".
    `one_stage_barrier` alone is read from the version (see LIMITS.one_stage_barrier_release).
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
    one_stage_barrier: bool  # its 1-stage fused kernels end with a barrier (aiter#4346)
    fp8: torch.dtype | None = None  # aiter.utility.dtypes.fp8, when readable


def _params(cls: Any, method: str) -> frozenset[str]:
    fn = getattr(cls, method, None)
    if fn is None:
        return frozenset()
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


_VERSION = re.compile(r"v?(\d+(?:\.\d+)*)(?:\.?post(\d+))?(?:\.?dev(\d+))?(?:\+.*)?")


def _version_key(version: str) -> tuple | None:
    """PEP 440 order for releases, post- and dev-releases (a local label ignored); None for
    anything else (pre-releases, "unknown")."""
    m = _VERSION.fullmatch(version.strip())
    if m is None:
        return None
    release = tuple(int(n) for n in m.group(1).split("."))
    release += (0,) * (4 - len(release))
    post = int(m.group(2)) if m.group(2) else -1
    # (release, post, 0, n) for a dev release sorts before (release, post, 1, 0), the release.
    return release, post, *((0, int(m.group(3))) if m.group(3) else (1, 0))


def has_one_stage_barrier(version: str) -> bool:
    """Whether this aiter's 1-stage fused kernels end with aiter#4346's barrier. A dev build
    counts from main's first dev number with the fix; anything unreadable counts as without."""
    key = _version_key(version)
    if key is None:
        return False
    is_dev = key[2] == 0
    floor = _version_key(LIMITS.one_stage_barrier_dev if is_dev else LIMITS.one_stage_barrier_release)
    return key >= floor


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
        one_stage_barrier=has_one_stage_barrier(version),
        fp8=fp8,
    )


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
    if api.choose_stage and not api.one_stage_barrier:
        log.info("arfusion: aiter %s: its 1-stage fused kernels lack the closing barrier of aiter#4346 "
                 "(in releases from %s, builds of main from %s); arfusion uses the 2-stage kernel",
                 api.version, LIMITS.one_stage_barrier_release, LIMITS.one_stage_barrier_dev)
    return Detected(arch=family, api=api, custom_ar=custom_ar)


def quant_dtype(arch: str) -> torch.dtype:
    return LIMITS.fp8_dtypes[arch]


def quant_disabled_by_env() -> bool:
    return os.environ.get(DISABLE_QUANT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
