"""transformers' continuous batching (`generate_batch`, `init_continuous_batching`) compiled without
a graph break per attention call.

transformers 5.19 to 5.24 wrap `PagedAttentionCache.update` in `torch.compiler.disable`: it writes
the new keys and values into overlapping views of one cache tensor, which compile's functionalization
would copy whole for every layer. Every attention call is then a graph break, and with Dynamo's
default a break inside a nested call also splits every frame around it: the o_proj and down_proj
all-reduces end one graph, the residual add and the norm start the next, and no site fuses.

`keep_paged_cache_in_graph` keeps the update in the graph without changing what it computes:
- each cache made from then on gets, as its own `update`, transformers' function without the
  decorator; Dynamo traces it (it picks this layer's indices and lengths out of the batch's kwargs);
- the cache writes and reads, which transformers does in its allocators' `update`, run inside one
  opaque custom op, `arfusion::hf_paged_kv_update`, whose body calls that same method. The graph gets
  fresh keys and values and mutates none of its inputs: nothing is functionalized or copied;
- the op finds its cache by the storage it writes (each cache owns one pool tensor), so a graph
  compiled for one `generate_batch` call serves the next one's new cache without a recompile.

The decode fast path with Flash Attention (block tables: the flash kernel writes the cache) keeps
transformers' update and its graph break. transformers 5.17 traces its update as it is and needs
nothing. Where the layout is not the one above, nothing changes and the pass names the graph break
in its log and in `stats()["split_by_graph_breaks"]`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from typing import Any, Callable

import torch

log = logging.getLogger("arfusion")

OP = "arfusion::hf_paged_kv_update"
CACHE_UPDATE_PARAMS = ("self", "key_states", "value_states", "layer_idx", "kwargs")
ALLOCATOR_UPDATE_PARAMS = ("self", "key_states", "value_states", "layer_idx", "read_index", "write_index")

# The caches made since `keep_paged_cache_in_graph`, by the storage address of their pool.
_caches: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
# transformers' `PagedAttentionCache.update` without its decorator (set by keep_paged_cache_in_graph).
_undecorated_update: Callable | None = None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _dense(out: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """`out` as a contiguous tensor that aliases no input (a custom op's outputs never do)."""
    return out.clone(memory_format=torch.contiguous_format) if out is given else out.contiguous()


@torch.library.custom_op(OP, mutates_args=())
def paged_kv_update(key_states: torch.Tensor, value_states: torch.Tensor, read_index: torch.Tensor,
                    write_index: torch.Tensor, cache: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own allocator update for layer `layer_idx`: writes `key_states` and
    `value_states` at `write_index` into the paged cache that `cache` (an allocator's view of its
    pool) belongs to, and returns the keys and values at `read_index` (the inputs where nothing is
    read). Declared pure: what it writes is read by this op alone, never by another graph node."""
    owner = _caches.get(_storage(cache))
    if owner is None:
        raise RuntimeError("arfusion: a paged KV cache that arfusion did not prepare reached arfusion::hf_paged_kv_update "
                           "(made before arfusion.hf.prepare_for_compile, or freed)")
    allocator = owner.layer_to_allocator[layer_idx]
    keys, values = type(allocator).update(allocator, key_states, value_states, layer_idx, read_index, write_index)
    return _dense(keys, key_states), _dense(values, value_states)


@paged_kv_update.register_fake
def _(key_states, value_states, read_index, write_index, cache, layer_idx):
    rows = key_states.shape[0] if read_index.numel() == 0 else read_index.shape[0]
    return (key_states.new_empty((rows, *key_states.shape[1:])),
            value_states.new_empty((rows, *value_states.shape[1:])))


def _allocator_update(self, key_states, value_states, layer_idx, read_index, write_index):
    """An allocator's `update` as the compiler sees it: the op above. Run eagerly, transformers'
    method itself."""
    if not torch.compiler.is_compiling():
        return type(self).update(self, key_states, value_states, layer_idx, read_index, write_index)
    return torch.ops.arfusion.hf_paged_kv_update(key_states, value_states, read_index, write_index,
                                                 self.cache_tensor, layer_idx)


def _cache_update(self, key_states, value_states, layer_idx, kwargs):
    """`PagedAttentionCache.update` without its `torch.compiler.disable`, which Dynamo traces; the
    block-table path (Flash Attention's decode fast path) keeps transformers' compiled-out one."""
    if kwargs.get("block_table") is not None:
        return type(self).update(self, key_states, value_states, layer_idx, kwargs)
    return _undecorated_update(self, key_states, value_states, layer_idx, kwargs)


def _params(fn: Callable) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _prepare(cache) -> str | None:
    """Gives one new cache the traceable update and registers it; None, or why it cannot."""
    pool = getattr(cache, "cache_tensor", None)
    allocators = getattr(cache, "layer_to_allocator", None)
    if not isinstance(pool, torch.Tensor) or not isinstance(allocators, dict):
        return "the cache has no cache_tensor pool or no layer_to_allocator map"
    for allocator in set(allocators.values()):
        view = getattr(allocator, "cache_tensor", None)
        if not isinstance(view, torch.Tensor) or _storage(view) != _storage(pool):
            return f"{type(allocator).__name__} does not keep its cache in the pool tensor"
        if _params(type(allocator).update) != ALLOCATOR_UPDATE_PARAMS:
            return f"{type(allocator).__name__}.update takes {_params(type(allocator).update)}"
    _caches[_storage(pool)] = cache
    cache.update = types.MethodType(_cache_update, cache)
    for allocator in set(allocators.values()):
        allocator.update = types.MethodType(_allocator_update, allocator)
    return None


def _paged_cache_class():
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
    except ImportError:
        return None
    return PagedAttentionCache


def keep_paged_cache_in_graph() -> tuple[bool, str]:
    """Makes every `PagedAttentionCache` created from now on keep its update inside compiled
    graphs (see the module docstring). Returns (whether caches now do, what was found). Idempotent;
    `release_paged_cache` undoes it."""
    cls = _paged_cache_class()
    if cls is None:
        return False, "the installed transformers has no continuous batching"
    if getattr(cls.__init__, "_arfusion_original", None) is not None:
        return True, "already prepared"
    update = cls.update
    if not getattr(update, "_torchdynamo_disable", False):
        return False, "PagedAttentionCache.update is traced as it is (nothing to prepare)"
    if _params(getattr(update, "__wrapped__", None) or update) != CACHE_UPDATE_PARAMS:
        return False, (f"PagedAttentionCache.update takes {_params(update)}, not the layout arfusion knows "
                       f"{CACHE_UPDATE_PARAMS}: its graph break stays")
    global _undecorated_update
    _undecorated_update = update.__wrapped__
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        reason = _prepare(self)
        if reason:
            log.info("arfusion: this paged KV cache keeps transformers' compiled-out update (a graph break per "
                     "attention call): %s", reason)

    __init__._arfusion_original = original_init
    cls.__init__ = __init__
    log.info("arfusion: continuous batching: each new paged KV cache runs its update inside the compiled graph "
             "(%s, transformers' own code), instead of the graph break of its torch.compiler.disable", OP)
    return True, "prepared"


def release_paged_cache() -> None:
    """Undoes `keep_paged_cache_in_graph` for caches made from now on."""
    cls = _paged_cache_class()
    original = getattr(cls.__init__, "_arfusion_original", None) if cls is not None else None
    if original is not None:
        cls.__init__ = original
