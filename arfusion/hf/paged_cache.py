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

The decode fast path with Flash Attention 2/3 (block tables: `flash_attn_with_kvcache` writes the
new keys and values into the cache and attends over it) has two graph breaks per attention call:
the update's `torch.compiler.disable`, and the one transformers puts around the kernel
(`_flash_with_kvcache_fn` in `modeling_flash_attention_utils`). Both go the same way:
- the update's block-table branch is traced too (it only picks this layer's cache views, block
  table and lengths);
- on each new cache, transformers' wrapped kernel is replaced by one whose compiled form is one
  opaque custom op, `arfusion::hf_paged_flash_kvcache`, whose body calls that same kernel with the
  same arguments. Declared pure like the update's op; it checks that the cache views it gets are a
  prepared cache's own (never a copy), and takes the keywords transformers passes to FA2 and FA3
  (with any other keyword the call keeps transformers' graph break, which the pass names).

transformers 5.17 traces its update as it is and needs nothing. Where the layout is not the one
above, nothing changes and the pass names the graph break in its log and in
`stats()["split_by_graph_breaks"]`.
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
    """`PagedAttentionCache.update` without its `torch.compiler.disable`, which Dynamo traces: on
    the block-table path (the decode fast path) it only hands the kernel this layer's cache views."""
    return _undecorated_update(self, key_states, value_states, layer_idx, kwargs)


# ----------------------------------------------------------------------------- decode fast path
FLASH_OP = "arfusion::hf_paged_flash_kvcache"
# The keywords transformers 5.24 passes to flash_attn_with_kvcache (FA2: block_table; FA3: page_table,
# max_seqlen_q; sink kernels: s_aux or learnable_sink), by kind.
FLASH_TENSOR_KEYS = ("block_table", "page_table", "cache_seqlens", "s_aux", "learnable_sink")
# The constants in the op's order of arguments.
FLASH_CONSTANT_KEYS = ("causal", "softmax_scale", "window_size", "softcap", "dropout_p", "deterministic",
                       "max_seqlen_q", "max_seqlen_k")
# The kernels behind the replaced wrappers, by name (the op takes the name).
_kernels: dict[str, Callable] = {}


def _kernel_name(kernel: Callable) -> str:
    return f"{getattr(kernel, '__module__', '?')}.{getattr(kernel, '__qualname__', repr(kernel))}"


@torch.library.custom_op(FLASH_OP, mutates_args=())
def paged_flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                        v: torch.Tensor | None, tensors: list[torch.Tensor], tensor_keys: str, causal: bool | None,
                        softmax_scale: float | None, window_size: list[int] | None, softcap: float | None,
                        dropout_p: float | None, deterministic: bool | None, max_seqlen_q: int | None,
                        max_seqlen_k: int | None, kernel: str) -> torch.Tensor:
    """transformers' `flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **keywords)` for one layer:
    writes `k` and `v` into the paged cache through the block table and returns the attention output.
    The keywords are the tensors named by `tensor_keys` (comma-separated) and the constants not None.
    Declared pure: the cache it writes is read by this op alone, never by another graph node."""
    if _caches.get(_storage(k_cache)) is None or _storage(v_cache) != _storage(k_cache):
        raise RuntimeError(f"arfusion: {FLASH_OP} got cache tensors that are not a paged KV cache arfusion prepared "
                           "(made before arfusion.hf.prepare_for_compile, freed, or copied by the compiler)")
    keywords: dict[str, Any] = dict(zip(tensor_keys.split(","), tensors)) if tensor_keys else {}
    window = None if window_size is None else tuple(window_size)
    constants = (causal, softmax_scale, window, softcap, dropout_p, deterministic, max_seqlen_q, max_seqlen_k)
    keywords.update({key: value for key, value in zip(FLASH_CONSTANT_KEYS, constants) if value is not None})
    out = _kernels[kernel](q, k_cache, v_cache, k, v, **keywords)
    return _dense(out[0] if isinstance(out, tuple) else out, q)


@paged_flash_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, tensors, tensor_keys, causal, softmax_scale, window_size, softcap, dropout_p,
      deterministic, max_seqlen_q, max_seqlen_k, kernel):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))


def _flash_kvcache_in_graph(disabled: Callable, kernel: Callable) -> Callable:
    """transformers' compiled-out `flash_attn_with_kvcache` (`disabled`, around `kernel`) as the
    compiler sees it: the op above. Run eagerly, or with a keyword the op does not take, the
    wrapper transformers made."""
    name = _kernel_name(kernel)
    _kernels[name] = kernel
    known = FLASH_TENSOR_KEYS + FLASH_CONSTANT_KEYS

    @functools.wraps(kernel)
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, **keywords):
        if not torch.compiler.is_compiling() or not all(key in known for key in keywords):
            return disabled(q, k_cache, v_cache, k, v, **keywords)
        tensor_keys = ",".join(key for key, value in keywords.items() if isinstance(value, torch.Tensor))
        tensors = [value for value in keywords.values() if isinstance(value, torch.Tensor)]
        constants = {key: keywords.get(key) for key in FLASH_CONSTANT_KEYS}
        if constants["window_size"] is not None:
            constants["window_size"] = list(constants["window_size"])  # a custom op takes a list, not a tuple
        return torch.ops.arfusion.hf_paged_flash_kvcache(q, k_cache, v_cache, k, v, tensors, tensor_keys,
                                                         *constants.values(), name)

    flash_attn_with_kvcache._arfusion_disabled = disabled
    return flash_attn_with_kvcache


def _flash_utils():
    try:
        from transformers import modeling_flash_attention_utils
    except ImportError:
        return None
    return modeling_flash_attention_utils


def _keep_flash_kvcache_in_graph() -> str | None:
    """Replaces the kernel transformers loaded for the decode fast path, if any, by the wrapper
    above (once per kernel load); None, or why it cannot."""
    utils = _flash_utils()
    current = getattr(utils, "_flash_with_kvcache_fn", None) if utils is not None else None
    if current is None or getattr(current, "_arfusion_disabled", None) is not None:
        return None
    kernel = getattr(current, "_torchdynamo_orig_callable", None)
    if not getattr(current, "_torchdynamo_disable", False) or kernel is None:
        return f"{_kernel_name(current)} is not the torch.compiler.disable wrapper arfusion knows: left as it is"
    utils._flash_with_kvcache_fn = _flash_kvcache_in_graph(current, kernel)
    log.info("arfusion: continuous batching's decode fast path: %s runs inside the compiled graph (%s), instead of "
             "the graph break of transformers' torch.compiler.disable", _kernel_name(kernel), FLASH_OP)
    return None


def _release_flash_kvcache() -> None:
    utils = _flash_utils()
    disabled = getattr(getattr(utils, "_flash_with_kvcache_fn", None), "_arfusion_disabled", None)
    if disabled is not None:
        utils._flash_with_kvcache_fn = disabled


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
    reason = _keep_flash_kvcache_in_graph()
    if reason:
        log.info("arfusion: the decode fast path's flash_attn_with_kvcache: %s", reason)
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
    """Undoes `keep_paged_cache_in_graph` for caches made from now on, and gives transformers back
    its compiled-out `flash_attn_with_kvcache`."""
    cls = _paged_cache_class()
    original = getattr(cls.__init__, "_arfusion_original", None) if cls is not None else None
    if original is not None:
        cls.__init__ = original
    _release_flash_kvcache()
