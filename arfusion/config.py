"""User-facing configuration of the fusion pass."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

log = logging.getLogger("arfusion")

BACKEND_CHOICES = ("auto", "flashinfer", "aiter", "torch")
QUANT_FORMS = ("fp8_static", "fp8_dynamic", "fp8_group", "nvfp4")
DISABLE_ENV = "ARFUSION_DISABLE"

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
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass
class PassConfig:
    """What the pass fuses and where.

    max_size_mb: per world size, the largest per-rank input (MiB, inclusive) that is fused;
        it overrides the backend's own table (0 turns fusion off for that world size).
    quant_forms: which quantization tails may be fused into the same op.
    unfused_on_current_stream: a matched site left unfused at compile time gets its all-reduce
        as a blocking NCCL call on the caller's stream instead of Inductor's side-stream one
        (GPUs only; 2-5% faster per site inside CUDA graphs on H200, docs/benchmarks.md).
    fuse_moe_combine: a site whose all-reduce input is an MoE top-k combine (HF grouped experts:
        `(rows * w)[inv_perm].view(T, K, H).sum(1)`) takes the combine into its op too
        (`arfusion::moe_combine_allreduce_rmsnorm`; FlashInfer's MoE finalize kernel at decode sizes).
    """

    enable_allreduce_fusion: bool = False
    backend: str = "auto"
    max_size_mb: dict[int, float] = field(default_factory=dict)
    enable_quant_fusion: bool = True
    quant_forms: tuple[str, ...] = QUANT_FORMS
    unfused_on_current_stream: bool = True
    fuse_moe_combine: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"arfusion: backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        self.max_size_mb = {int(k): float(v) for k, v in dict(self.max_size_mb).items()}
        for ws, mb in self.max_size_mb.items():
            if ws < 1 or mb < 0:
                raise ValueError(f"arfusion: max_size_mb needs world size >= 1 and MiB >= 0, got {ws}: {mb}")
        self.quant_forms = tuple(self.quant_forms)
        unknown = set(self.quant_forms) - set(QUANT_FORMS)
        if unknown:
            raise ValueError(f"arfusion: unknown quant_forms {sorted(unknown)}; choose from {QUANT_FORMS}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> "PassConfig":
        """Load `{"pass_config": {...}}` (vLLM style), the inner dict, or its JSON text."""
        if isinstance(data, str):
            data = json.loads(data)
        if "pass_config" in data:
            data = data["pass_config"]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
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

    def fused_quant_forms(self) -> tuple[str, ...]:
        return self.quant_forms if self.enable_quant_fusion else ()

    def key(self) -> str:
        """Stable text identifying this config, for cache keys."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
