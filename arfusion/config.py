"""User-facing configuration of the fusion pass."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .core import QUANT_FORMS, QUANTIZED_LEVELS

log = logging.getLogger("arfusion")

BACKEND_CHOICES = ("auto", "flashinfer", "aiter", "torch")
DISABLE_ENV = "ARFUSION_DISABLE"
STRICT_ENV = "ARFUSION_STRICT"
# The env switch that picks a quantized all-reduce level where the config names none.
QUANTIZED_ENV = "ARFUSION_QUANTIZED_ALLREDUCE"
_OFF = ("", "0", "false", "no", "off", "none")

# vLLM pass_config keys that mean nothing to arfusion; accepted so a vLLM config loads as is.
_VLLM_KEYS_IGNORED = frozenset({
    "fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "enable_sp", "fuse_gemm_comms",
    "enable_fusion", "enable_noop", "enable_attn_fusion", "enable_sequence_parallelism",
    "enable_async_tp", "fuse_act_padding", "fuse_rope_kvcache", "fuse_mla_dual_rms_norm",
    "enable_qk_norm_rope_fusion", "eliminate_noops", "fuse_allreduce_rms",
})
# vLLM spells a few of ours differently.
_ALIASES = {
    "fi_allreduce_fusion_max_size_mb": "max_size_mb",
    "allreduce_fusion_max_size_mb": "max_size_mb",
    "fuse_allreduce_rms": "enable_allreduce_fusion",
}


def env_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in _OFF


def env_strict() -> bool:
    """ARFUSION_STRICT=1: an error inside the pass fails the compile instead of leaving the graph
    unfused (for arfusion's own tests and for bug reports)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in _OFF


def _per_world_mb(name: str, value: Mapping) -> dict[int, float]:
    table = {int(k): float(v) for k, v in dict(value).items()}
    for ws, mb in table.items():
        if ws < 1 or mb < 0:
            raise ValueError(f"arfusion: {name} needs world size >= 1 and MiB >= 0, got {ws}: {mb}")
    return table


@dataclass
class PassConfig:
    """What the pass fuses and where.

    enable_allreduce_fusion: True by default (`PassConfig(backend="torch")` fuses). A vLLM-style
        dict (`from_dict`) keeps vLLM's default, off, unless it sets the flag. A pass installed
        with it off says so once at INFO and leaves graphs as they are.
    max_size_mb: per world size, the largest per-rank input (MiB, inclusive) that is fused;
        it overrides the backend's own table (0 turns fusion off for that world size).
    quant_forms: which quantization tails may be fused into the same op.
    unfused_on_current_stream: a matched site left unfused at compile time gets its all-reduce
        as a blocking NCCL call on the caller's stream instead of Inductor's side-stream one
        (GPUs only; 2-5% faster per site inside CUDA graphs on H200,
        docs/history/2026-11-26-benchmarks-before-the-matrix.md).
    fuse_moe_combine: a site whose all-reduce input is an MoE top-k combine (HF grouped experts:
        `(rows * w)[inv_perm].view(T, K, H).sum(1)`) takes the combine into its op too
        (`arfusion::moe_combine_allreduce_rmsnorm`). On FlashInfer only with
        ARFUSION_FLASHINFER_MOE_FINALIZE=1 (in Qwen3-MoE and DeepSeek-V2 decode steps on 2xH200
        its finalize kernel was 2-3% slower than the path without it; docs/flashinfer.md); otherwise Inductor
        compiles the combine and the site fuses alone.
    quantized_allreduce: None (exact, the default) or a payload format of QUANTIZED_LEVELS. Lossy
        and opt-in: a site whose per-rank message is at or above the backend's measured
        crossover runs a quantized all-reduce, then the compiled add+RMSNorm (+quant); below
        it, the exact path. Where unset, the ARFUSION_QUANTIZED_ALLREDUCE environment variable
        may name a level. Check what it costs on your model: benchmarks/eval_accuracy.py.
    quantized_allreduce_min_mb: per world size, the per-rank MiB (inclusive) from which the
        quantized all-reduce is used, overriding the backend's crossover (0: every site).
    fast_all_reduce: every sum all-reduce that is not fused into a site (LayerNorm models,
        hyper-connections, sites a backend declines, graph-boundary all-reduces) runs the
        backend's fast plain all-reduce (`arfusion::all_reduce`: FlashInfer's one-shot kernel,
        aiter's custom all-reduce) where its table says it beats NCCL, NCCL elsewhere.
    plain_max_size_mb: per world size, the largest per-rank input (MiB, inclusive) that the fast
        plain all-reduce takes, overriding the backend's table (0: never).
    """

    enable_allreduce_fusion: bool = True
    backend: str = "auto"
    max_size_mb: dict[int, float] = field(default_factory=dict)
    enable_quant_fusion: bool = True
    quant_forms: tuple[str, ...] = QUANT_FORMS
    unfused_on_current_stream: bool = True
    fuse_moe_combine: bool = True
    quantized_allreduce: str | None = None
    quantized_allreduce_min_mb: dict[int, float] = field(default_factory=dict)
    fast_all_reduce: bool = True
    plain_max_size_mb: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"arfusion: backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        self.max_size_mb = _per_world_mb("max_size_mb", self.max_size_mb)
        self.quantized_allreduce_min_mb = _per_world_mb("quantized_allreduce_min_mb",
                                                        self.quantized_allreduce_min_mb)
        self.plain_max_size_mb = _per_world_mb("plain_max_size_mb", self.plain_max_size_mb)
        level, named_by, off = self.quantized_allreduce, "quantized_allreduce", "None"
        if level is None and os.environ.get(QUANTIZED_ENV, "").strip():
            level, named_by, off = os.environ[QUANTIZED_ENV], f"the environment variable {QUANTIZED_ENV}", "off"
            log.info("arfusion: quantized all-reduce %r from %s", level, QUANTIZED_ENV)
        named = None if level is None or str(level).strip().lower() in _OFF else str(level).strip().lower()
        if named is not None and named not in QUANTIZED_LEVELS:
            raise ValueError(f"arfusion: {named_by} must be {off} or one of {QUANTIZED_LEVELS}, got {level!r}")
        self.quantized_allreduce = named
        self.quant_forms = tuple(self.quant_forms)
        unknown = set(self.quant_forms) - set(QUANT_FORMS)
        if unknown:
            raise ValueError(f"arfusion: unknown quant_forms {sorted(unknown)}; choose from {QUANT_FORMS}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> "PassConfig":
        """Load `{"pass_config": {...}}` (vLLM style), the inner dict, or its JSON text. As in
        vLLM, the fusion is off unless the dict turns it on (`enable_allreduce_fusion` or
        vLLM's `fuse_allreduce_rms`)."""
        if isinstance(data, str):
            data = json.loads(data)
        if "pass_config" in data:
            data = data["pass_config"]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {"enable_allreduce_fusion": False}
        for key, value in data.items():
            key = _ALIASES.get(key, key)
            if key in known:
                kwargs[key] = value
            elif key in _VLLM_KEYS_IGNORED:
                log.info("arfusion: ignoring vLLM pass_config key %r", key)
            else:
                raise ValueError(f"arfusion: unknown pass_config key {key!r}; known keys: {sorted(known)}")
        return cls(**kwargs)

    def max_bytes(self, world_size: int) -> int | None:
        """The user's cap for this world size in bytes, or None to use the backend's table."""
        mb = self.max_size_mb.get(world_size)
        return None if mb is None else int(mb * 1024 * 1024)

    def plain_max_bytes(self, world_size: int) -> int | None:
        """The user's cap for the fast plain all-reduce in bytes, or None to use the backend's table."""
        mb = self.plain_max_size_mb.get(world_size)
        return None if mb is None else int(mb * 1024 * 1024)

    def codec_min_bytes(self, world_size: int) -> int | None:
        """The user's quantized all-reduce threshold in bytes, or None for the backend's crossover."""
        mb = self.quantized_allreduce_min_mb.get(world_size)
        return None if mb is None else round(mb * 1024 * 1024)

    def fused_quant_forms(self) -> tuple[str, ...]:
        return self.quant_forms if self.enable_quant_fusion else ()

    def key(self) -> str:
        """Stable text identifying this config, for cache keys."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
