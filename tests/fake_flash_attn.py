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


# The schema vLLM 0.25.1's `_vllm_fa3_C.abi3.so` registers (read from it with torch 2.11), without
# its alias annotations: what benchmarks/flash_attn3/flash_attn_interface.py calls by position.
FA3_SCHEMA = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor? out, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k, "
    "int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale, "
    "Tensor? v_descale, float softmax_scale, bool is_causal, int window_size_left, int window_size_right, "
    "float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits, bool? pack_gqa, "
    "int sm_margin, Tensor? s_aux, int cp_world_size, int cp_rank, Tensor? cp_tot_seqused_k) -> Tensor[]")
_FA3_LIBRARY = []


def _fa3_fwd(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
             max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
             q_descale, k_descale, v_descale, softmax_scale, is_causal, window_left, window_right, softcap,
             rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin, s_aux, cp_world_size, cp_rank,
             cp_tot_seqused_k):
    """FA3's forward for the three layouts the shim uses: batched q [B, Sq, H, D] with k, v
    [B, Sk, Hk, D]; packed q and k, v by cumulative lengths; packed q over a paged k, v
    [pages, page_size, Hk, D] read through page_table up to seqused_k. Anything else is refused."""
    if any(t is not None for t in (k_new, v_new, q_v, out, cu_seqlens_k_new, seqused_q, kv_batch_idx, leftpad_k,
                                   rotary_cos, q_descale, s_aux)) or cp_world_size != 1:
        raise NotImplementedError("fake _vllm_fa3_C::fwd: only what arfusion's FA3 shim passes")
    CALLS["_vllm_fa3_C::fwd"] += 1
    window = (window_left, window_right)
    result = q.new_zeros(*q.shape[:-1], v.shape[-1])
    if cu_seqlens_q is None:
        for b in range(q.shape[0]):
            result[b] = _attend(q[b], k[b], v[b], softmax_scale, is_causal, window, softcap)
        return [result, q.new_zeros(0)]
    cq = cu_seqlens_q.tolist()
    for b in range(len(cq) - 1):
        if page_table is not None:
            used, page = int(seqused_k[b]), k.shape[1]
            slots = [p * page + s for p in page_table[b].tolist()[:math.ceil(used / page)] for s in range(page)][:used]
            keys, values = k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]
        else:
            ck = cu_seqlens_k.tolist()
            keys, values = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        if cq[b + 1] > cq[b] and len(keys):
            result[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], keys, values, softmax_scale, is_causal, window,
                                              softcap)
    return [result, q.new_zeros(0)]


def register_fake_fa3() -> Counter:
    """Registers `_vllm_fa3_C::fwd` (CPU) once, as the stand-in under the FA3 shim; returns the log."""
    if not _FA3_LIBRARY:
        lib = torch.library.Library("_vllm_fa3_C", "DEF")
        lib.define(FA3_SCHEMA)
        lib.impl("fwd", _fa3_fwd, "CPU")
        torch.library.register_fake("_vllm_fa3_C::fwd", lambda q, k, v, *rest: [
            q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(0)], lib=lib)
        _FA3_LIBRARY.append(lib)
    CALLS.clear()
    return CALLS


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
