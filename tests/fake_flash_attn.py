"""A stand-in for Flash Attention 2 (`flash_attn`), for CPU tests of transformers' continuous-batching
decode fast path (no GPU, no flash-attn wheel).

`install_fake_flash_attn()` registers `flash_attn` and `flash_attn.bert_padding` in sys.modules with
the calls transformers 5.24 imports: `flash_attn_varlen_func` (prefill: packed sequences by
cu_seqlens) and `flash_attn_with_kvcache` (decode: writes the new keys and values into a paged cache
through a block table at `cache_seqlens`, then attends over the cache), both causal bottom-right
aligned, with GQA, a sliding window and softcap, in plain torch (fp32 softmax, one Python loop over
sequences: the models are tiny). It returns the call log (`CALLS`, by function). Both are custom
ops (`fake_flash_attn::varlen`, `fake_flash_attn::kvcache`): Dynamo sees each as one opaque node,
as it sees flash-attn 2.7's varlen op (its kvcache call is a pybind function, a graph break of its
own; transformers' `torch.compiler.disable` around it breaks the graph either way).
`remove_fake_flash_attn()` takes them out again.

Used by tests/test_cb_fast_path.py. Nothing here says anything about Flash Attention's kernels.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from collections import Counter

import torch

CALLS: Counter = Counter()
VERSION = "2.8.3"  # what the fake claims: above transformers' 2.3.3 floor


def _attend(q, k, v, scale, causal, window, softcap):
    """One sequence: q [Sq, Hq, D], k and v [Sk, Hk, D] -> [Sq, Hq, Dv]; queries are the last Sq
    positions of the Sk keys (bottom-right alignment); window (left, right), -1 for none."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(sq).unsqueeze(1) + (sk - sq)
    col = torch.arange(sk).unsqueeze(0)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= col <= row
    if window[0] >= 0:
        allowed &= col >= row - window[0]
    if window[1] >= 0:
        allowed &= col <= row + window[1]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


@torch.library.custom_op("fake_flash_attn::varlen", mutates_args=())
def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, softmax_scale: float, causal: bool, window_left: int,
           window_right: int, softcap: float) -> torch.Tensor:
    CALLS["flash_attn_varlen_func"] += 1
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i + 1] > bq[i] and bk[i + 1] > bk[i]:
            out[bq[i]:bq[i + 1]] = _attend(q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]],
                                           softmax_scale, causal, (window_left, window_right), softcap)
    return out


@varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("fake_flash_attn::kvcache", mutates_args=("k_cache", "v_cache"))
def kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
            v: torch.Tensor | None, cache_seqlens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
            causal: bool, window_left: int, window_right: int, softcap: float) -> torch.Tensor:
    CALLS["flash_attn_with_kvcache"] += 1
    out = q.new_zeros(*q.shape[:-1], v_cache.shape[-1])
    page = k_cache.shape[1]
    new = 0 if k is None else k.shape[1]
    for b, (past, pages) in enumerate(zip(cache_seqlens.tolist(), block_table.tolist())):
        total = past + new
        if past < 0 or total == 0:  # a padding row
            continue
        used = pages[:math.ceil(total / page)]
        if min(used) < 0:
            raise ValueError(f"fake flash_attn_with_kvcache: sequence {b} needs {len(used)} pages, has {pages}")
        slots = torch.tensor([p * page + s for p in used for s in range(page)][:total])
        keys, values = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        if new:
            keys[slots[past:]] = k[b]
            values[slots[past:]] = v[b]
        out[b] = _attend(q[b], keys[slots], values[slots], softmax_scale, causal, (window_left, window_right),
                         softcap)
    return out


@kvcache.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_left, window_right,
      softcap):
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's signature; dropout, ALiBi, attention probabilities and block tables refused."""
    if dropout_p or alibi_slopes is not None or return_attn_probs or block_table is not None:
        raise NotImplementedError("fake flash_attn_varlen_func: dropout, alibi, probs and block tables")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.ops.fake_flash_attn.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, *window_size,
                                            float(softcap or 0.0))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's signature; the paged layout only (block table and per-sequence lengths)."""
    if block_table is None or not isinstance(cache_seqlens, torch.Tensor):
        raise NotImplementedError("fake flash_attn_with_kvcache: a block table and a cache_seqlens tensor only")
    if rotary_cos is not None or cache_batch_idx is not None or cache_leftpad is not None or alibi_slopes is not None \
            or return_softmax_lse:
        raise NotImplementedError("fake flash_attn_with_kvcache: rotary, batch index, left pad, alibi, lse")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.ops.fake_flash_attn.kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal,
                                             *window_size, float(softcap or 0.0))


def flash_attn_func(*args, **kwargs):
    raise NotImplementedError("fake flash_attn: only the varlen and kvcache calls")


def install_fake_flash_attn() -> Counter:
    """Registers `flash_attn` (version `VERSION`) and `flash_attn.bert_padding`; returns the call log."""
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

    def module(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = m
        return m

    root, padding = module("flash_attn"), module("flash_attn.bert_padding")
    root.__version__, root.bert_padding = VERSION, padding
    root.flash_attn_func, root.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    root.flash_attn_with_kvcache = flash_attn_with_kvcache
    padding.pad_input, padding.unpad_input = _pad_input, _unpad_input
    CALLS.clear()
    return CALLS


def remove_fake_flash_attn() -> None:
    for name in ("flash_attn.bert_padding", "flash_attn"):
        sys.modules.pop(name, None)
