"""Every number the aiter backend decides by, the environment variables it reads, and the one
function that turns aiter's custom all-reduce window into the plain all-reduce's caps.

Sources, all public:
* aiter files are ROCm/aiter's, named by path: CA = aiter/dist/device_communicators/
  custom_all_reduce.py, COMM = aiter/dist/device_communicators/communicator_cuda.py,
  QR = aiter/dist/device_communicators/quick_all_reduce.py, CUH = csrc/include/
  custom_all_reduce.cuh, CU = csrc/kernels/custom_all_reduce.cu; read in the amd-aiter
  0.1.7.post2.dev18 wheel (PyPI), at ROCm/aiter 86a98ee, at 03644e5 (a branch) and at main e404860;
* vLLM files by path (vllm/_aiter_ops.py), vLLM, SGLang and aiter pull requests by number
  (vllm#N, SGLang#N, aiter#N).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class AiterLimits:
    """Byte limits are per-rank input bytes and inclusive."""

    # The archs aiter ships kernels for: the 0.1.7 wheel's hsa/gfx942 and hsa/gfx950 asm
    # kernels; CA at e404860 gives gfx1250 a kernel and transport of its own.
    archs: tuple[str, ...] = ("gfx942", "gfx950")
    # aiter/utility/dtypes.py (`fp8`): e4m3fnuz (max 240) on gfx942, e4m3fn (max 448) on gfx950.
    fp8_dtypes: dict[str, torch.dtype] = field(default_factory=lambda: {
        "gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn})
    # The fused kernel's world sizes: CUH of the 0.1.7 wheel dispatches 2, 4 and 8 and prints
    # "fused allreduce rmsnorm world size error" otherwise; COMM fused_allreduce_rmsnorm (03644e5)
    # also excludes 6 (`self.world_size != 6`, kept by SGLang#21986), though CA lists 6 as a plain
    # all-reduce size.
    world_sizes: tuple[int, ...] = (2, 4, 8)
    # COMM fused_allreduce_rmsnorm: n <= 16384 (also SGLang#21986).
    max_hidden: int = 16384
    # CA: PACK_SIZE = 16 // element_size; hidden must be whole packs (aiter#2453 via SGLang#21986).
    pack_bytes: int = 16
    # SGLang#21986: total bytes <= 8 * 1024 * 8192 (64 MiB), inclusive, matching CA's cutoff:
    # `inp_size <= 8192 * 8192` before aiter#4233, the default of AITER_CUSTOM_AR_MAX_SIZE after.
    # Also the plain all-reduce's largest size (custom_ar_window): every aiter version read takes
    # it with arfusion's registered buffer.
    max_bytes: int = 64 * MIB
    # CA's registered input buffer. vLLM vllm/_aiter_ops.py uses 8192*1024*8*2 and takes half as
    # the usable size (aiter v0.1.10.post3 accepts <= max_size / 2), so 2 x max_bytes fits all
    # versions; aiter main's default (1 GiB, ~3 GiB per rank in total) is far more than needed.
    registered_buffer_bytes: int = 2 * 64 * MIB
    # CUH kMaxBlocks = 80: the 1-stage kernel runs one block per token (SGLang#21986).
    one_stage_max_tokens: int = 80
    # vLLM vllm/_aiter_ops.py: 1-stage needs hidden / pack <= 1024 (bf16 H <= 8192).
    one_stage_max_packs: int = 1024
    # vLLM vllm/_aiter_ops.py 1-stage size rule: ws=2 any size (the token limit bounds it), ws=4
    # < 256 KiB, ws=8 < 128 KiB (vLLM uses "<"; every byte limit here is inclusive, one rule).
    one_stage_max_bytes: dict[int, int | None] = field(default_factory=lambda: {
        2: None, 4: 256 * KIB, 8: 128 * KIB})
    # aiter#4346 (commit 0e47575, 2026-07-28) ended CUH's 1-stage fused kernels (all-reduce +
    # RMSNorm, and its per-token, per-group and MXFP4 quant forms) with a barrier; without it "a
    # faster rank may advance while a peer is still reading the previous invocation, causing
    # silent cross-request corruption" (CUH). No signature marks the fix, only the version:
    # releases hold it from v0.1.19.post1 (v0.1.19 does not); builds of main from v0.1.19-2,
    # which setuptools_scm numbers 0.1.20.dev2. Older aiter gets the 2-stage kernel.
    one_stage_barrier_release: str = "0.1.19.post1"
    one_stage_barrier_dev: str = "0.1.20.dev2"
    # vLLM vllm/_aiter_ops.py treats aiter without `_pool` (an IPCBufferPool, aiter >= 0.1.12) as
    # old: 1-stage only for these hidden sizes ...
    legacy_one_stage_hidden: tuple[int, ...] = (512, 1024, 2048, 4096)
    # ... and the 0.1.7 fused 2-stage kernel (CUH, "fused allreduce rmsnorm shape error") needs
    # 1024 <= H * elem <= 32768, a multiple of 1024.
    legacy_row_bytes: tuple[int, int, int] = (1024, 32768, 1024)  # (min, max, multiple)
    # SGLang#24651: the one-kernel AR+RMSNorm+quant dispatch is gated to gfx95x.
    one_kernel_quant_archs: tuple[str, ...] = ("gfx950",)
    # SGLang#24651 / COMM fused_allreduce_rmsnorm_quant_per_group: group 128, fp32 scales [T, H/128].
    quant_group_size: int = 128
    # COMM fused_allreduce_rmsnorm_quant: the per-token kernel only for these hidden sizes
    # (7168 bf16/fp16 only; arfusion sends nothing else) and <= 4096 KiB; others go to stage 2.
    per_token_quant_hidden: tuple[int, ...] = (512, 1024, 2048, 4096, 7168)
    per_token_quant_max_bytes: int = 4 * MIB

    # Plain custom all-reduce (CustomAllreduce.custom_all_reduce; the same in 0.1.7, 86a98ee,
    # 03644e5 and e404860). CU: "custom allreduce only supports float32, float16 and bfloat16".
    plain_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    # CA _SUPPORTED_WORLD_SIZES (the communicator is disabled for others); CU init_custom_ar
    # also throws for > 8 and odd sizes.
    plain_world_sizes: tuple[int, ...] = (2, 4, 6, 8)
    # CA should_custom_ar / _fits_custom_ar_size: input bytes % 16 == 0, else None.
    plain_align_bytes: int = 16
    # CA _DEFAULT_CAR_MIN_SIZE (aiter#4233): custom all-reduce only for sizes strictly above it.
    custom_ar_default_min_bytes: int = 0

    # Quick all-reduce (QR, QuickAllReduce, and csrc/kernels/quick_all_reduce.cu, in the
    # 0.1.7.post2.dev18 wheel and ROCm/aiter main).
    # QR _SUPPORTED_DTYPES; the kernel throws on anything else.
    quick_reduce_dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    # QR _SUPPORTED_WORLD_SIZES; init_custom_qr throws for > 8, 6 and odd sizes.
    quick_reduce_world_sizes: tuple[int, ...] = (2, 4, 8)
    # QR _should_hip (0.1.7 wheel), should_quick_allreduce (main e404860): input bytes % 16 == 0.
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
# aiter's own variables for its custom all-reduce window (CA, aiter#4233), read with aiter's
# defaults and rules: custom all-reduce runs for input bytes in (MIN, MAX].
CUSTOM_AR_MIN_SIZE_ENV = "AITER_CUSTOM_AR_MIN_SIZE"  # int bytes; unset, unparsable or < 0: 0
CUSTOM_AR_MAX_SIZE_ENV = "AITER_CUSTOM_AR_MAX_SIZE"  # int bytes; 0: off; unset, bad or < 0: 64 MiB
# aiter's own environment variables for its QuickAllReduce, read with the same defaults.
QUICK_REDUCE_CAST_ENV = "AITER_QUICK_REDUCE_CAST_BF16_TO_FP16"  # int, default 1: bf16 runs fp16 kernels
QUICK_REDUCE_MAX_SIZE_ENV = "AITER_QUICK_REDUCE_MAX_SIZE_BYTES_MB"  # int MiB, <= 0 or unset: 2 GiB
# arfusion level -> QuickReduceRegime member. aiter has no INT8 codec: its level 1 is FP8.
QUICK_REDUCE_REGIMES = {"fp8": "FP8", "int6": "INT6", "int4": "INT4"}
# What arfusion calls on the `aiter` module (aiter/ops/quick_all_reduce.py, star-imported there).
QUICK_REDUCE_OPS = ("init_custom_qr", "qr_destroy", "qr_all_reduce", "qr_get_handle", "qr_open_handles",
                    "qr_max_size")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def custom_ar_window() -> tuple[int, int]:
    """(low, high): aiter's custom all-reduce takes input bytes in (low, high]; high 0: none.

    aiter's own window (CA _resolve_car_min_size and _resolve_car_max_size, aiter#4233): low from
    CUSTOM_AR_MIN_SIZE_ENV (unset, unparsable or negative: 0); high from CUSTOM_AR_MAX_SIZE_ENV
    (unset, unparsable or negative: 64 MiB; 0: off; above the registered pool: 64 MiB), capped at
    LIMITS.max_bytes. Older aiter has no window (0.1.7 and 86a98ee take <= max_size, later ones
    <= 64 MiB) and takes every size of this one. The environment is the same on every rank, as
    aiter assumes too."""
    low = _env_int(CUSTOM_AR_MIN_SIZE_ENV)
    low = LIMITS.custom_ar_default_min_bytes if low is None or low < 0 else low
    high = _env_int(CUSTOM_AR_MAX_SIZE_ENV)
    # Above 64 MiB aiter takes up to the value or falls back to 64 MiB: arfusion stops at 64 either way.
    high = LIMITS.max_bytes if high is None or high < 0 else min(high, LIMITS.max_bytes)
    return low, high
