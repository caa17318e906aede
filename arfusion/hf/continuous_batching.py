"""A `ContinuousBatchingConfig` that asks transformers only for what it will do here.

- A compile config for the decode path only where transformers has one: its decode fast path
  (block tables) needs Flash Attention 2/3 on CUDA (or 2 on XPU). Elsewhere decode steps take
  the varlen path, and transformers drops a decode config with a warning ("A decode_compile_config
  was set but fast decode path is not available. Ignoring it.").
- NCCL's graph mixing left alone unless the default process group is NCCL's: by default
  transformers sets NCCL_GRAPH_MIXING_SUPPORT=0 for any run with WORLD_SIZE > 1, and says so,
  also over gloo, where NCCL plays no part.

transformers is imported inside the functions (`import arfusion.hf` does not import it).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def graph_mixing_kwargs() -> dict:
    """`disable_nccl_graph_mixing=False` where the field exists and the default group is not
    NCCL's (gloo, the fake group, no group); else nothing: transformers' default."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return {} if nccl or "disable_nccl_graph_mixing" not in _fields(ContinuousBatchingConfig) \
        else {"disable_nccl_graph_mixing": False}


def decode_fast_path(model) -> bool:
    """Whether transformers' continuous batching has its decode fast path for `model`: transformers'
    own check where it has one, else its documented rule (Flash Attention on CUDA)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    try:
        from transformers.generation.continuous_batching.initialization import ensure_decode_fast_path_is_available
        asked = ContinuousBatchingConfig(max_blocks_per_request=2, **graph_mixing_kwargs())
        ensure_decode_fast_path_is_available(model.config.get_text_config(), asked, False)
        return asked.max_blocks_per_request > 0
    except (ImportError, TypeError, AttributeError):  # another transformers: the rule
        attention = str(getattr(model.config, "_attn_implementation", None) or "")
        return attention.startswith("flash_attention") and model.device.type == "cuda"


def cb_config(model, compile_config=None, **options):
    """`ContinuousBatchingConfig(**options)` with `compile_config` (a `CompileConfig`, or None:
    nothing compiled) for the varlen path, and for the decode path where `decode_fast_path(model)`."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    paths = {}
    if compile_config is not None:
        paths["varlen_compile_config"] = compile_config
        if decode_fast_path(model):
            paths["decode_compile_config"] = compile_config
    return ContinuousBatchingConfig(**{**graph_mixing_kwargs(), **paths, **options})
