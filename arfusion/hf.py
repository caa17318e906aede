"""Hugging Face helpers that do not depend on the installed transformers version.

transformers is imported lazily, inside the functions: `import arfusion` never imports it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

log = logging.getLogger("arfusion")


def _config_has_tp_plan(config_cls: type) -> bool:
    if dataclasses.is_dataclass(config_cls):
        if any(f.name == "tp_plan" for f in dataclasses.fields(config_cls)):
            return True
    try:
        return "tp_plan" in inspect.signature(config_cls).parameters
    except (TypeError, ValueError):
        return False


def _from_pretrained_accepts(name: str) -> bool:
    """True if `PreTrainedModel.from_pretrained` takes keyword `name`, as a named parameter or
    popped from its **kwargs (transformers 5.x pops `distributed_config` from kwargs)."""
    from transformers import PreTrainedModel

    method = PreTrainedModel.from_pretrained
    try:
        if name in inspect.signature(method).parameters:
            return True
    except (TypeError, ValueError):
        pass
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return f'"{name}"' in source or f"'{name}'" in source


def tp_kwargs(tp_plan: Any = "auto") -> dict:
    """Keyword arguments for `from_pretrained` that load the model tensor-parallel with `tp_plan`.

    `{"distributed_config": DistributedConfig(tp_plan=tp_plan)}` where the installed transformers
    takes it (>= 5.18 deprecates the bare argument), `{"tp_plan": tp_plan}` otherwise (older
    releases, where `DistributedConfig` lacks `tp_plan` or `from_pretrained` ignores
    `distributed_config`). Decided by what the installed version offers, not by its version string.
    """
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan}
    if _config_has_tp_plan(DistributedConfig) and _from_pretrained_accepts("distributed_config"):
        return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}
    return {"tp_plan": tp_plan}


# transformers <= 5.17 implements its `replicated_with_grad_allreduce` TP style (Qwen3's, Gemma 3's,
# ... per-head q_norm / k_norm) with a module-level full backward hook that all-reduces the norm's
# weight gradient. torch builds that hook's wrapper on every forward, under no_grad too, and Dynamo
# breaks the graph there: every layer compiles in pieces and no all-reduce meets its norm (nothing
# fuses). 5.23 uses parameter-level hooks, added only when grad is enabled, and compiles whole.
_GRAD_ALLREDUCE_HOOK = ("transformers.distributed.tensor_parallel", "ReplicatedWithGradAllReduce.")


def drop_grad_allreduce_hooks(model) -> int:
    """Removes those gradient-only hooks from a model loaded for inference, so that torch.compile
    sees whole graphs; returns how many it removed (0 on transformers versions without them).
    Other backward hooks are left alone. Do not call it on a model you will train."""
    dropped = 0
    for module in model.modules():
        for key, hook in list(module._backward_hooks.items()):
            qualname = getattr(hook, "__qualname__", "")
            if getattr(hook, "__module__", "") == _GRAD_ALLREDUCE_HOOK[0] and \
                    qualname.startswith(_GRAD_ALLREDUCE_HOOK[1]):
                del module._backward_hooks[key]
                dropped += 1
    if dropped:
        log.info(
            "arfusion: removed %d gradient all-reduce backward hook(s) of transformers' replicated_with_grad_allreduce "
            "TP style (inference only): Dynamo broke the graph at each", dropped)
    return dropped
