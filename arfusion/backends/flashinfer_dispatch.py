"""Where FlashInfer's fused all-reduce pays: the one place holding the size thresholds.

Two sources, the first that has an entry wins:

1. a tuned cache written by `arfusion tune` on the user's machine, keyed by
   (GPU name, world size, hidden, dtype) and holding the measured crossover token counts;
2. the seeded table below, keyed by (SM major, world size, dtype), in bytes per rank.

Every value a decision reads (shapes, dtype, world size, GPU model, the files' content) is the
same on every rank of a single-node group, so all ranks choose the same path. The workspace
agreement in flashinfer.py also compares a hash of these tables across the group.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decisions import Reason, Why
from .base import tables_changed

MiB = 1 << 20
CACHE_ENV = "ARFUSION_TUNE_CACHE"
CACHE_VERSION = 1
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Never fused above this, whatever a table or override says: the largest cap any peer uses,
# and 8192 x 8192 bf16 (128 MiB) hung or faulted in FlashInfer (flashinfer#1986). It also
# bounds the workspace (about 4 x world x this per rank).
HARD_MAX_FUSED_BYTES = 64 * MiB

# FlashInfer's workspace creation allocates, then meets the other ranks in a rendezvous: a rank
# that fails to allocate leaves its peers waiting there (seen on an H100 with the failure
# injected). So every rank first checks its free memory against an upper bound of the workspace
# (0.7.2.post1's trtllm_create_ipc_workspace_for_all_reduce_fusion: a data buffer of
# world x tokens x hidden elements and a Lamport buffer of 3x that, 4 bytes each at most) plus
# this margin, and the ranks agree before anyone allocates.
WORKSPACE_MARGIN_BYTES = 256 * MiB


def workspace_bytes_bound(world: int, max_tokens: int, hidden: int) -> int:
    return 4 * 4 * world * max_tokens * hidden + WORKSPACE_MARGIN_BYTES


# FlashInfer's creation exchanges the buffers' handles with all_gather_object over the group: a rank
# that raised before reaching it (inside FlashInfer, where no pre-check sees) leaves its peers there
# until the group's own timeout (NCCL's watchdog then aborts the process). Each of those collectives
# is preceded by an arrival check through the store that gives up after this long: the ranks have
# just agreed to create (one collective before), and creation takes 0.2-5 s on H200.
WORKSPACE_EXCHANGE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Limits:
    """Per-rank input bytes: fuse while <= max_fused_bytes (inclusive); one-shot while
    <= oneshot_max_bytes, two-shot above (two-shot also needs tokens > world size)."""

    max_fused_bytes: int
    oneshot_max_bytes: int
    source: str


# (SM major, world size) -> (fuse up to, one-shot up to), MiB per rank, for 16-bit inputs.
#  - SM90 worlds 2 and 4: our H200 sweep (docs/history/2026-11-26-benchmarks-before-the-matrix.md).
#    Fused only while it beats NCCL
#    all_reduce *in place* + compiled add+RMSNorm, the unfused path of a real model:
#    world 2 one-shot wins up to 32 MiB (1.02x there) and loses at 64 MiB (0.95x);
#    world 4 one-shot wins up to 2 MiB, two-shot from there up to 8 MiB (1.03x), and loses at
#    16 MiB (0.97x). vLLM's SM90 table fuses more (64 / 2 MiB) and never uses two-shot at world 4.
#  - SM90 world 8 and SM100: vLLM's FI_ALLREDUCE_FUSION_MAX_SIZE_MB and one-shot tables
#    (SM100 takes its B200 column, the most conservative of the SM10x columns). Unmeasured here.
# World 16 has no single-node data: only a tuned entry or a user cap enables it.
_SEED_16BIT: dict[tuple[int, int], tuple[float, float]] = {
    (9, 2): (32, 32),
    (9, 4): (8, 2),
    (9, 8): (0.5, 0.5),
    (10, 2): (64, 32),
    (10, 4): (32, 4),
    (10, 8): (1, 1),
}

# Per-group FP8 runs FlashInfer's plain kernel and then a compiled quant kernel. On H200 at
# world 4 that quant kernel took 3-4x its standalone time behind the two-shot kernel (forced
# fusion at 16 MiB: 0.80x of unfused); at 4 MiB fusion still won (1.04x); 8 MiB is unmeasured.
# So per-group sites fuse only up to this many MiB there (static/dynamic FP8 use the table).
# World 2 (4xH200, 2026-11-28, docs/data/matrix/matrix_h200x4_2026-11-28_f.md, hidden 4096, against
# NCCL in place + compiled add+RMSNorm+quant): fused one-shot 1.22x at 4 MiB, 0.80x at 16 MiB
# (127 vs 101 us; the table's 32 MiB cap fused it); 8 MiB unmeasured, so 4. SM100 is unmeasured and
# its table fuses more (64 / 32 MiB): it takes SM90's entry, as the scaled-input cap does.
GROUP_QUANT_MAX_MIB: dict[tuple[int, int], float] = {(9, 2): 4, (9, 4): 4}

# A site whose all-reduce input is scaled by a number first (Granite's multiplier: f * AR(x), run
# as AR(f * x)) pays one more elementwise pass over the input where the kernel runs (the unfused
# path folds f into its compiled norm). Fused only while the plain site's measured gain covers it:
# on H200 an elementwise pass costs ~2 us + 2 x bytes / ~3.5 TB/s (2.6 us at 1 MiB, 6.8 at 8, 11.6
# at 16), and the fused site gained over NCCL + compiled norm
# (docs/history/2026-11-26-benchmarks-before-the-matrix.md, column a0 - b, hidden 4096) 13 us at
# 8 MiB but 7 at 16 MiB (world 2), 10 us at 4 MiB but 4 at 8 MiB (world 4).
# Estimated from those two measurements, not measured with a scale; SM100 takes SM90's entry.
SCALED_INPUT_MAX_MIB: dict[tuple[int, int], float] = {(9, 2): 8, (9, 4): 4}

# Quant forms whose FlashInfer kernel needs a newer GPU / CUDA than the rest: the one place
# saying so. NVFP4 (codes 3/5): the FP4 conversion and its scale writes are compiled only for
# __CUDA_ARCH__ >= 1000 and CUDA >= 12.8 (trtllm_allreduce_fusion.cuh in 0.7.2.post1); below
# that the kernel runs and silently writes zeros. Read from the source, never run here.
QUANT_MIN_SM: dict[str, int] = {"nvfp4": 10}
QUANT_MIN_CUDA: dict[str, tuple[int, int]] = {"nvfp4": (12, 8)}


def quant_problem(form: str, sm_major: int, cuda_version: str | None) -> str | None:
    """Why FlashInfer's kernel for this quant form cannot run on this GPU / CUDA, or None."""
    min_sm = QUANT_MIN_SM.get(form)
    if min_sm is not None and sm_major < min_sm:
        return (f"FlashInfer's {form} kernel needs SM{min_sm}0+ (this GPU is SM{sm_major}x, where it "
                "would write zeros); the op computes it unfused")
    min_cuda = QUANT_MIN_CUDA.get(form)
    if min_cuda is not None:
        have = tuple(int(p) for p in (cuda_version or "0.0").split(".")[:2])
        if have < min_cuda:
            return f"FlashInfer's {form} kernel needs CUDA {min_cuda[0]}.{min_cuda[1]}+, torch has {cuda_version}"
    return None


# MoE top-k combine fused into the site (`trtllm_moe_finalize_allreduce_fusion`): (SM major, world
# size) -> largest token count (inclusive) it is used for; above it, or where no entry is, the op
# combines in torch and runs the ordinary fused site. 2xH200, HF grouped-experts layout, K=8, vs
# compiled combine + NCCL + compiled add+norm (docs/history, MoE kernels on 2xH200): hidden 2048 1.51/1.56/1.26/0.65/
# 0.44x at T=1/8/32/64/128, hidden 4096 1.50/1.75/1.18x at T=1/8/32: decode sizes only. Other
# worlds and GPUs are unmeasured (tests/gpu/check_moe_combine.py measures them).
MOE_FINALIZE_MAX_TOKENS: dict[tuple[int, int], int] = {(9, 2): 32}
# ...but only on request: timed in the model against what the op does without it (compiled combine +
# the plain fused site), it was slower: the Qwen3-30B-A3B-shaped decode step (8 layers, TP=2, 2xH200,
# 2026-11-28, docs/benchmarks.md) took 1.052 / 1.902 ms with it at batch 1 / 8 against 1.029 / 1.867
# without (op level, the same day: faster only at some hidden 2048 sizes). Its old hazard is
# closed: FlashInfer's finalize kernel reads each peer's values from that peer's Lamport buffer,
# which the peer re-arms at its next call on the workspace; sharing the plain kernel's workspace,
# queued calls hung (two H200s; two ranks on one H100). It now alternates between two workspaces
# of its own (flashinfer.FinalizeWorkspaces), and on one H100 queued calls and CUDA graphs finish.
# One order stays open: a graph replayed back to back whose only collectives on the group are an
# odd number of finalize calls; the pass keeps the combine out of graphs without another
# collective on the group (docs/flashinfer.md).
MOE_FINALIZE_OPT_IN_ENV = "ARFUSION_FLASHINFER_MOE_FINALIZE"
MOE_FINALIZE_OFF_REASON = (f"FlashInfer's MoE finalize kernel is opt-in ({MOE_FINALIZE_OPT_IN_ENV}=1): in a "
                           f"Qwen3-MoE and a DeepSeek-V2 decode step on 2xH200 it was 2-3% slower than the compiled "
                           "combine + fused site")


def moe_finalize_opted_in() -> bool:
    return os.environ.get(MOE_FINALIZE_OPT_IN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def moe_finalize_problem(sm_major: int, world_size: int, tokens: int | None) -> Reason | None:
    """Why FlashInfer's MoE finalize kernel is not used for this call (tokens None: not known yet)."""
    if not moe_finalize_opted_in():
        return Reason(Why.NO_KERNEL, MOE_FINALIZE_OFF_REASON)
    cap = MOE_FINALIZE_MAX_TOKENS.get((sm_major, world_size))
    if cap is None:
        return Reason(Why.NO_TABLE, f"no MoE-finalize dispatch entry for SM {sm_major}x, world size {world_size}")
    if tokens is not None and tokens > cap:
        return Reason(Why.SIZE_CAP, f"{tokens} tokens > {cap} (MoE finalize pays at decode sizes only)")
    return None


# Quantized all-reduce (`flashinfer.comm.quantized_allreduce.quantized_all_reduce`: FP8 payload,
# two-shot over torch symmetric memory, bf16 only): (SM major, world size) -> {level: MiB per rank
# from which it is used, inclusive}. SM90 world 2, 2xH200 in CUDA graphs at the site (hidden 4096,
# quantized all-reduce + compiled add+RMSNorm; docs/history/2026-11-26-benchmarks-before-the-matrix.md)
# against FlashInfer's exact fused kernel: 0.52/0.76/0.95/1.19/1.25/1.25x at 1/2/4/8/16/32 MiB;
# against NCCL + the same norm (the exact path above the 32 MiB fused cap) 1.26x all-reduce alone
# at 64 MiB. Hence 8 MiB (again on 4xH200 on 2026-11-28: 0.97/1.19/1.23/1.24x at 4/8/16/32 MiB).
# SM90 world 4, 4xH200, 2026-11-28
# (docs/data/matrix/matrix_h200x4_2026-11-28_f.md, same harness), against the exact path (the fused
# kernel up to 8 MiB, NCCL in place + compiled norm above): 0.90/1.31/1.38/1.48/1.30/1.31/1.26x at
# 1/2/4/8/16/32/64 MiB. Hence 2 MiB. Other GPUs and worlds are unmeasured: `arfusion tune --quantized
# fp8` or quantized_allreduce_min_mb.
QUANTIZED_MIN_MIB: dict[tuple[int, int], dict[str, float]] = {(9, 2): {"fp8": 8}, (9, 4): {"fp8": 2}}
# The largest message measured (64 MiB: 1.26x); larger ones keep the exact path. It also sizes
# the symmetric buffer (about half of it: one byte per element plus scales).
QUANTIZED_MAX_BYTES = 64 * MiB
# FlashInfer's launch knobs for that call where other ones were measured faster than its own choice
# (`_select_params`, 0.7.2.post1: 4096-element blocks up to 64 MiB, P2P phase 3 from 32 MiB):
# (SM major, world size) -> ((from MiB per rank, knobs), ...) ascending; a message takes the last
# entry it reaches, up to QUANTIZED_MAX_BYTES, and one below the first keeps FlashInfer's knobs. The
# scale group (256 elements) is not a knob: the error stays (2.6e-2 in every setting). SM90 world 2,
# 2xH200, 2026-11-28, 24 settings per size in CUDA graphs (`bench_fused_op.py --quantized fp8
# --codec-knobs`; docs/data/matrix/matrix_h200x2_2026-11-28_i.md): 8 MiB 35.6 -> 33.7 us with
# 16384-element blocks; 16 / 32 / 64 MiB 71.5 / 132.7 / 263.9 -> 61.9 / 115.5 / 219.8 us with those
# and P2P phase 3 (32 and 64 MiB: 16 settings, block size 4096 or 16384). Between two sizes measured
# the smaller one's knobs: at 8 and at 16 MiB either entry's knobs beat FlashInfer's own.
QUANTIZED_KNOBS: dict[tuple[int, int], tuple[tuple[float, dict], ...]] = {
    (9, 2): ((8, {"block_size": 16384}), (16, {"block_size": 16384, "p2p_phase3": True})),
}
# The knobs' names and the values timed: every combination in `bench_fused_op.py --codec-knobs`;
# `arfusion tune --quantized fp8 --knobs` times the two that moved on 2xH200 (TUNE_KNOBS), with the
# others at FlashInfer's own values. None of them changes the error.
CODEC_KNOBS = {"block_size": (4096, 8192, 16384), "max_num_blocks": (66, 132), "num_warps": (8, 16),
               "p2p_phase3": (False, True)}
TUNE_KNOBS = {"block_size": (4096, 8192, 16384), "p2p_phase3": (False, True)}


def knob_combinations(values: dict[str, tuple]) -> list[dict]:
    """Every combination of the knobs' values, as keyword arguments."""
    return [dict(zip(values, combo)) for combo in itertools.product(*values.values())]


# The plain all-reduce (`arfusion::all_reduce`, FlashInfer's one-shot kAllReduce on the group's
# fused-kernel workspace): (SM major, world size) -> MiB per rank up to which (inclusive) it replaces
# NCCL. It is measured against NCCL's all-reduce alone, so its caps sit below the fused site's.
# SM90 worlds 2 and 4: 2xH200 / 4xH200, hidden 4096, in CUDA graphs, FlashInfer's fused kernel took
# 0.50-0.79x of NCCL all_reduce alone up to T = 512 (4 MiB) at world 2 and up to T = 128 (1 MiB) at
# world 4 (docs/history/2026-11-26-benchmarks-before-the-matrix.md, per-site table:
# fi_fused vs nccl_ar); the plain kernel does less
# than the fused one, so these are conservative until `arfusion tune` measures the plain kernel
# itself. SM90 world 8 and SM100: vLLM's one-shot caps (vLLM PR #52998 makes this kernel its
# default TP all-reduce with the caps of vllm/compilation/passes/fusion/allreduce_rms_fusion.py),
# unmeasured here.
PLAIN_MAX_MIB: dict[tuple[int, int], float] = {
    (9, 2): 4,
    (9, 4): 1,
    (9, 8): 0.5,
    (10, 2): 32,
    (10, 4): 4,
    (10, 8): 1,
}


def plain_max_bytes(sm_major: int, gpu_name: str, world_size: int, hidden: int,
                    dtype: torch.dtype) -> tuple[int | None, str]:
    """(largest per-rank bytes the plain all-reduce takes, inclusive, or None: no entry; source)."""
    entry = tuned_entries().get(tuned_key(gpu_name, world_size, hidden, dtype))
    if entry is not None and "plain_max_tokens" in entry:
        return int(entry["plain_max_tokens"]) * hidden * torch.empty((), dtype=dtype).element_size(), \
            f"tuned cache {cache_path()}"
    mib = PLAIN_MAX_MIB.get((sm_major, world_size)) if dtype in HALF_DTYPES else None
    if mib is None:
        return None, (f"no plain all-reduce entry for SM {sm_major}x, world size {world_size}, {dtype} "
                      "(run `arfusion tune` or set plain_max_size_mb)")
    return int(mib * MiB), f"seed table SM{sm_major}x world {world_size} (plain)"


SEED_TABLE: dict[tuple[int, int, torch.dtype], Limits] = {
    (sm, ws, dtype): Limits(int(cap * MiB), int(one * MiB), f"seed table SM{sm}x world {ws}")
    for (sm, ws), (cap, one) in _SEED_16BIT.items() for dtype in HALF_DTYPES
}
SUPPORTED_SM_MAJORS = frozenset(sm for sm, _ in _SEED_16BIT)


def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arfusion" / "flashinfer-tuning.json"


def tuned_key(gpu_name: str, world_size: int, hidden: int, dtype: torch.dtype) -> str:
    return f"{gpu_name}|world={world_size}|hidden={hidden}|{str(dtype).removeprefix('torch.')}"


@functools.cache
def _read_cache(path: str) -> tuple[dict, str]:
    """(entries, sha256 of the file) or ({}, "") when absent; unreadable files count as absent."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError):
        return {}, ""
    if data.get("version") != CACHE_VERSION:
        return {}, ""
    return dict(data.get("entries", {})), hashlib.sha256(raw).hexdigest()[:16]


def tuned_entries() -> dict:
    return _read_cache(str(cache_path()))[0]


def cache_hash() -> str:
    """Content hash of the tuned cache ("" when none): part of the pass uuid."""
    return _read_cache(str(cache_path()))[1]


def forget_cache() -> None:
    """Re-read the cache next time (after `arfusion tune` wrote it in this process)."""
    _read_cache.cache_clear()
    limits_for.cache_clear()
    _knob_steps.cache_clear()
    tables_changed()


@functools.lru_cache(maxsize=256)
def limits_for(sm_major: int, gpu_name: str, world_size: int, hidden: int,
               dtype: torch.dtype) -> Limits | None:
    """The limits that apply, or None when neither a tuned entry nor the table covers it."""
    entry = tuned_entries().get(tuned_key(gpu_name, world_size, hidden, dtype))
    if entry is not None:
        row = hidden * torch.empty((), dtype=dtype).element_size()
        return Limits(int(entry["max_fused_tokens"]) * row, int(entry["oneshot_max_tokens"]) * row,
                      f"tuned cache {cache_path()}")
    return SEED_TABLE.get((sm_major, world_size, dtype))


def codec_min_bytes(sm_major: int, gpu_name: str, world_size: int, hidden: int, dtype: torch.dtype,
                        level: str) -> tuple[int | None, str]:
    """(per-rank bytes from which the `level` quantized all-reduce is used, where the number comes
    from); None where neither a tuned entry nor the table has one, or tuning found it never pays."""
    entry = tuned_entries().get(tuned_key(gpu_name, world_size, hidden, dtype))
    tuned = (entry or {}).get("quantized_min_tokens", {})
    if level in tuned:
        if tuned[level] is None:
            return None, f"tuned cache {cache_path()}: the {level} all-reduce was never faster here"
        return int(tuned[level]) * hidden * torch.empty((), dtype=dtype).element_size(), f"tuned cache {cache_path()}"
    mib = QUANTIZED_MIN_MIB.get((sm_major, world_size), {}).get(level)
    if mib is None:
        return None, (f"no measured {level} all-reduce crossover for SM {sm_major}x, world size {world_size} "
                      f"(run `arfusion tune --quantized {level}` or set quantized_allreduce_min_mb)")
    return int(mib * MiB), f"seed table SM{sm_major}x world {world_size}"


@functools.lru_cache(maxsize=256)  # read at each eager call of the quantized all-reduce
def _knob_steps(sm_major: int, gpu_name: str, world_size: int, hidden: int, dtype: torch.dtype,
                level: str) -> tuple[list[tuple[int, dict]], str]:
    """((from bytes per rank, knobs), ...) ascending, and where they come from: a tuned entry
    (`arfusion tune --quantized LEVEL --knobs`, steps in tokens) before the table."""
    entry = tuned_entries().get(tuned_key(gpu_name, world_size, hidden, dtype)) or {}
    tuned = entry.get("quantized_knobs", {}).get(level)
    if tuned is not None:
        row = hidden * torch.empty((), dtype=dtype).element_size()
        return [(int(t) * row, dict(k)) for t, k in tuned], f"tuned cache {cache_path()}"
    return ([(int(mib * MiB), knobs) for mib, knobs in QUANTIZED_KNOBS.get((sm_major, world_size), ())],
            f"table SM{sm_major}x world {world_size}")


def codec_knobs(sm_major: int, gpu_name: str, world_size: int, hidden: int, dtype: torch.dtype, nbytes: int,
                level: str = "fp8") -> dict:
    """Launch knobs for FlashInfer's quantized all-reduce of `nbytes` per rank: the last step the
    message reaches; {} (FlashInfer's own) below the first."""
    chosen = {}
    for from_bytes, knobs in _knob_steps(sm_major, gpu_name, world_size, hidden, dtype, level)[0]:
        if nbytes >= from_bytes:
            chosen = knobs
    return chosen


def codec_knobs_text(sm_major: int, gpu_name: str, world_size: int, hidden: int, dtype: torch.dtype,
                     level: str = "fp8") -> str:
    """Which launch knobs the quantized all-reduce runs with here, for the log."""
    steps, source = _knob_steps(sm_major, gpu_name, world_size, hidden, dtype, level)
    if not steps:
        return "FlashInfer's own launch knobs (none measured for this GPU and world size)"
    return f"launch knobs from the {source}: " + steps_text(steps)


def knobs_text(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) or "FlashInfer's own"


def steps_text(steps, unit: str = "MiB") -> str:
    """'from 8 MiB block_size=16384; ...' for ((from bytes, knobs), ...); unit "tokens": steps in token counts;
    no steps: FlashInfer's own knobs everywhere."""
    return "; ".join((f"from {start / MiB:g} MiB " if unit == "MiB" else f"from {start} tokens ") + knobs_text(knobs)
                     for start, knobs in steps) or knobs_text({})


def _cap_or_sm90(table: dict[tuple[int, int], float], sm_major: int, world_size: int) -> int | None:
    """A per-form cap in bytes per rank; a GPU without its own entry takes SM90's (measured); None: no limit."""
    mib = table.get((sm_major, world_size), table.get((9, world_size)))
    return None if mib is None else int(mib * MiB)


def group_quant_cap(sm_major: int, world_size: int) -> int | None:
    """Bytes per rank up to which a per-group FP8 site may fuse, beyond the table; None: no limit."""
    return _cap_or_sm90(GROUP_QUANT_MAX_MIB, sm_major, world_size)


def scaled_input_cap(sm_major: int, world_size: int) -> int | None:
    """Bytes per rank up to which a site with a scaled input may fuse, beyond the table; None: no limit."""
    return _cap_or_sm90(SCALED_INPUT_MAX_MIB, sm_major, world_size)


def use_oneshot(limits: Limits, tokens: int, nbytes: int, world_size: int) -> bool:
    # Two-shot splits tokens across ranks and asserts tokens > world size.
    return tokens <= world_size or nbytes <= limits.oneshot_max_bytes


def table_hash() -> str:
    """Identifies every input of dispatch; compared across ranks before a workspace is used."""
    seed = repr(sorted((k[0], k[1], str(k[2]), v.max_fused_bytes, v.oneshot_max_bytes)
                       for k, v in SEED_TABLE.items()))
    seed += repr(sorted(GROUP_QUANT_MAX_MIB.items())) + repr(sorted(QUANT_MIN_SM.items()))
    seed += repr(sorted(SCALED_INPUT_MAX_MIB.items()))
    seed += repr(sorted(MOE_FINALIZE_MAX_TOKENS.items())) + repr(sorted(QUANTIZED_MIN_MIB.items()))
    seed += repr(sorted(QUANTIZED_KNOBS.items()))
    seed += repr(sorted(PLAIN_MAX_MIB.items()))
    seed += repr(moe_finalize_opted_in())
    return hashlib.sha256(f"{seed}|{cache_hash()}".encode()).hexdigest()[:16]
