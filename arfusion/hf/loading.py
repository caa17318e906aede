"""How to ask transformers for a tensor-parallel load, in the spelling the installed version takes."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any


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
