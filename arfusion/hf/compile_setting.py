"""A recompile that torch 2.15 adds for a compiled TP model called from another thread than the
one that compiled it: transformers' continuous batching (`generate_batch`) compiles every graph
twice, and a later call may compile again.

In torch 2.15 the code Dynamo traces through transformers' TP hooks reads the setting
`torch.compiler.config.compile_on_one_rank`: `DeviceMesh.get_group` (`_maybe_traced_group`) and
`dist.all_reduce`, mapped to a functional all-reduce (`_group_or_group_name`). torch 2.13 had it as
a plain attribute of `torch.distributed.config`, the same in every thread. In 2.15 it is a config
entry, stored per thread in a `ContextVar`, and Dynamo guards a read on the stored value, not on
what it resolves to. The stored value is:
- unset (torch's sentinel) in a thread that never set it;
- `False` in a thread where Inductor compiled: its pattern matcher (`fwd_only`) patches the setting
  to False, and the patch's exit stores False, not the unset it found.
Both resolve to False. But continuous batching compiles in the caller's thread and runs its steps
in a generation thread of its own: the guards fail there, and every graph compiles again.

`same_compile_setting_in_every_thread` gives that `ContextVar` the resolved value (the environment
variable's or torch's default) as its default. Every thread then stores what a thread where
Inductor compiled stores, and the guards hold in every thread. What the setting resolves to is
unchanged everywhere; setting or patching it still works per thread. Where `torch.compiler.config`
has no such entry (torch 2.13) nothing changes.
"""

from __future__ import annotations

import contextvars
import logging

import torch.utils._config_module as config_module
from torch.compiler import config

log = logging.getLogger("arfusion")

NAME = "compile_on_one_rank"
_pinned: contextvars.ContextVar | None = None  # the ContextVar put in torch's config entry


def same_compile_setting_in_every_thread() -> tuple[bool, str]:
    """(done, why): `torch.compiler.config.compile_on_one_rank` stored the same way in every thread
    (once per process), so that Dynamo's guards on it do not differ by thread."""
    global _pinned
    unset = getattr(config_module, "_UNSET_SENTINEL", None)
    entry = getattr(config, "_config", {}).get(NAME)
    if entry is None:
        return False, f"torch.compiler.config has no {NAME} (torch < 2.15)"
    stored = getattr(entry, "user_override", None)
    if _pinned is not None and stored is _pinned:
        return True, "already done"
    if not isinstance(stored, contextvars.ContextVar):
        return False, f"{NAME} is not stored per thread"
    if getattr(entry, "justknob", None) is not None or getattr(entry, "alias", None) is not None:
        return False, f"{NAME} resolves through a knob or an alias: left as torch has it"
    env = getattr(entry, "env_value_default", unset)
    resolved = entry.default if env is unset else env
    pinned = contextvars.ContextVar(stored.name, default=resolved)
    here = stored.get()
    if here is not unset:
        pinned.set(here)  # this thread's own value, set or patched, stays
    entry.user_override = pinned
    _pinned = pinned
    if isinstance(getattr(config, "_hash_dirty_var", None), contextvars.ContextVar):
        config._hash_dirty_var.set(True)  # torch's caches of the config's hash and dict, as its own writes do
    if hasattr(config, "_mark_get_dict_dirty"):
        config._mark_get_dict_dirty(NAME)
    log.info("arfusion: torch.compiler.config.%s (%s) is stored alike in every thread: Dynamo guards it, and "
             "a graph compiled in one thread recompiled in another (torch 2.15, continuous batching)", NAME, resolved)
    return True, "done"
