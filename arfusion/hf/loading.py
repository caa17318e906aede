"""How to ask transformers for a tensor-parallel load, in the spelling the installed version takes."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any

import torch.distributed as dist

log = logging.getLogger("arfusion")


def _config_has_tp_plan(config_cls: type) -> bool:
    if _has_field(config_cls, "tp_plan"):
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


def tp_kwargs(tp_plan: Any = "auto", config: Any = None, tp_size: int | None = None) -> dict:
    """Keyword arguments for `from_pretrained` that load the model tensor-parallel with `tp_plan`,
    over `tp_size` ranks (None: transformers' default, WORLD_SIZE's).

    `{"distributed_config": DistributedConfig(tp_plan=tp_plan)}` where the installed transformers
    takes it (>= 5.18 deprecates the bare argument), `{"tp_plan": tp_plan}` otherwise (older
    releases, where `DistributedConfig` lacks `tp_plan` or `from_pretrained` ignores
    `distributed_config`). Decided by what the installed version offers, not by its version string.

    `config` (the model's config, or its checkpoint directory): where its TP plan leaves the
    experts of a mixture-of-experts model whole on every rank and an expert-parallel plan shards
    them (transformers >= 5.25 dropped the experts from every TP plan), the keywords also ask for
    expert parallelism over the same ranks (`ep_size` = the TP size). At inference transformers
    then runs each rank's experts and sums them with an all-reduce, the same all-reduce the TP plan
    of earlier releases made, which the pass fuses; without it every rank holds every expert.
    """
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan, **({"tp_size": tp_size} if tp_size else {})}
    if not (_config_has_tp_plan(DistributedConfig) and _from_pretrained_accepts("distributed_config")):
        return {"tp_plan": tp_plan, **({"tp_size": tp_size} if tp_size else {})}
    fields = {"tp_plan": tp_plan, **({"tp_size": tp_size} if tp_size else {})}
    if config is not None and _has_field(DistributedConfig, "ep_size"):
        config = _config(config)
        world = tp_size or _world_size()
        experts = expert_count(config)
        if world > 1 and experts_need_expert_parallel(config):
            if experts % world:
                log.info("arfusion: %d routed experts do not split over %d ranks: every rank holds every expert "
                         "(the TP plan's own choice)", experts, world)
            else:
                fields["ep_size"] = world
                log.info("arfusion: the TP plan leaves the experts whole on every rank: loading with expert "
                         "parallelism over the same %d ranks (ep_size=%d), whose all-reduce the pass fuses", world, world)
    return {"distributed_config": DistributedConfig(**fields)}


# Where configs keep the routed experts' count.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config: Any) -> int:
    """The routed experts' count of a MoE config (its text config's), 0 for a dense one."""
    for candidate in (config, config.get_text_config()):
        for name in EXPERT_COUNTS:
            value = getattr(candidate, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def experts_need_expert_parallel(config: Any) -> bool:
    """True where the model of `config` (a config, a checkpoint directory or a hub name) has an
    expert-parallel plan and its tensor-parallel plan shards none of the modules that plan names."""
    config = _config(config)
    for candidate in (config, config.get_text_config()):
        ep_plan = getattr(candidate, "base_model_ep_plan", None) or {}
        if ep_plan:
            tp_plan = getattr(candidate, "base_model_tp_plan", None) or {}
            return not any(key == module or key.startswith(module + ".") for key in tp_plan for module in ep_plan)
    return False


def _config(config: Any):
    if isinstance(config, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(config)  # what from_pretrained reads first
    return config


def _has_field(config_cls: type, name: str) -> bool:
    return dataclasses.is_dataclass(config_cls) and any(f.name == name for f in dataclasses.fields(config_cls))


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def say_if_experts_are_whole(model) -> bool:
    """Logs at INFO, and returns True, where `model` was loaded tensor-parallel with its experts whole
    on every rank although they could be sharded by expert parallelism over the same ranks (loaded
    without `tp_kwargs(..., config=)` on transformers >= 5.25): no experts' all-reduce to fuse, and
    every rank holds every expert."""
    config = getattr(model, "config", None)
    distributed = getattr(config, "distributed_config", None)
    tp = getattr(distributed, "tp_size", None) or 1
    if distributed is None or tp <= 1 or (getattr(distributed, "ep_size", None) or 1) > 1 \
            or not experts_need_expert_parallel(config):
        return False
    if expert_count(config) % tp:
        return False
    log.info("arfusion: every rank holds every expert (this transformers' TP plan leaves them whole): load with "
             "arfusion.hf.tp_kwargs(\"auto\", config=path) to shard them over the %d ranks by expert parallelism, "
             "whose all-reduce the pass fuses", tp)
    return True
