"""Flash Attention 3's Python interface (`flash_attn_interface`) over the FA3 kernels in vLLM's wheel.

For benchmarks only: transformers takes its continuous-batching decode fast path (a paged KV cache
read through a block table) only with a Flash Attention package, and none installs on the GPU
machines here (flash-attn 2 is a source build; flash-attn 4 is too large to carry and transformers
5.24 has no paged call for it). vLLM 0.25.1's wheel, built for torch 2.11 and CUDA 13 as those
machines are, ships FA3 for SM90 as one library, `_vllm_fa3_C.abi3.so` (153 MB, 8 MB as .xz).
It registers one op, `_vllm_fa3_C::fwd`; this module gives it the three calls transformers imports.
`benchmarks/device/fa3_setup.sh` unpacks the library and puts this folder (with its
`flash_attn_3` dist-info, the name transformers checks) on PYTHONPATH; `ARFUSION_FA3_SO` names it.

The op's arguments are read from its registered schema. The decode call writes the step's keys and
values into the paged cache with torch ops, then attends with the op over the block table (as vLLM
does: its cache write and its attention are separate). Rows of a padded batch (cache_seqlens -1)
write nothing and attend to nothing. Dropout, ALiBi, rotary, FP8 descales and returned
log-sum-exps are refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__version__ = "3.0.0b1"
SO = "_vllm_fa3_C.abi3.so"


def _load() -> None:
    """The op from ARFUSION_FA3_SO or beside this file, unless something registered it already
    (the CPU tests' stand-in)."""
    if hasattr(torch.ops._vllm_fa3_C, "fwd"):
        return
    path = Path(os.environ.get("ARFUSION_FA3_SO") or Path(__file__).with_name(SO))
    if not path.exists():
        raise ImportError(f"flash_attn_interface (arfusion's FA3 shim): no {SO} at {path}; "
                          "benchmarks/device/fa3_setup.sh unpacks it")
    torch.ops.load_library(str(path))


_load()


def _fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
         page_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0):
    """The attention output of `_vllm_fa3_C::fwd` with everything else off, through `attend`."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.ops.arfusion_fa3.attend(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                         page_table, float(scale), bool(causal), int(window_size[0]),
                                         int(window_size[1]), float(softcap or 0.0), int(num_splits))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
           cu_seqlens_k: torch.Tensor | None, seqused_k: torch.Tensor | None, max_seqlen_q: int | None,
           max_seqlen_k: int | None, page_table: torch.Tensor | None, softmax_scale: float, causal: bool,
           window_left: int, window_right: int, softcap: float, num_splits: int) -> torch.Tensor:
    """`arfusion_fa3::attend`: one opaque node for Dynamo, with a fake, as Flash Attention 3's own
    interface registers its forward: a compiled model's graph stays whole around attention (vLLM's
    op has no fake kernel, so Dynamo would break the graph there)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.ops._vllm_fa3_C.fwd(
        q, k, v, None, None, None, None,  # q, k, v, k_new, v_new, q_v, out
        cu_seqlens_q, cu_seqlens_k, None, None, seqused_k,  # cu q, cu k, cu k_new, seqused q, seqused k
        max_seqlen_q, max_seqlen_k, page_table, None, None,  # kv_batch_idx, leftpad_k
        None, None, None, None, None, None,  # rotary cos/sin/seqlens, q/k/v descale
        softmax_scale, causal, window_left, window_right, softcap,
        True, None, num_splits, None, 0,  # rotary interleaved, scheduler metadata, splits, pack_gqa, sm_margin
        None, 1, 0, None)  # s_aux, context-parallel world, rank, total seqused
    return out[0]


def _attend_fake(q, k, v, *rest):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


if not hasattr(torch.ops.arfusion_fa3, "attend"):  # once per process, also when the module is imported again
    torch.library.custom_op("arfusion_fa3::attend", attend, mutates_args=()).register_fake(_attend_fake)


def _refuse(refused: dict) -> None:
    """Any other keyword set to something (dropout, ALiBi, rotary, descales, probabilities, ...)."""
    bad = sorted(k for k, v in refused.items() if v is not None and not (isinstance(v, (bool, int, float)) and not v))
    if bad:
        raise NotImplementedError(f"arfusion's FA3 shim: {', '.join(bad)} not supported")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False, **refused):
    """q [B, Sq, H, D], k and v [B, Sk, Hk, D] -> [B, Sq, H, Dv]: as packed sequences of equal
    lengths (vLLM's build has the varlen kernels only)."""
    _refuse(refused)
    (batch, sq), sk = q.shape[:2], k.shape[1]
    cu_q, cu_k = (torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=q.device) for n in (sq, sk))
    out = _fwd(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
               max_seqlen_q=sq, max_seqlen_k=sk, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
               softcap=softcap)
    return out.view(batch, sq, *out.shape[1:])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False, **refused):
    """Packed sequences: q [Tq, H, D], k and v [Tk, Hk, D], cumulative lengths (int32)."""
    _refuse(refused)
    return _fwd(q, k, v, cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap)


def write_paged(cache: torch.Tensor, new: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor) -> None:
    """cache [pages, page_size, Hk, D] gets new[b] at positions[b] of sequence b's pages; rows with a
    negative position write nothing. No host sync: padding rows write their first valid row's value
    to its slot again (all duplicates carry one value), or, with none valid, slot 0's own value."""
    page = cache.shape[1]
    flat = cache.view(-1, *cache.shape[2:])
    valid = positions >= 0
    pos = positions.clamp(min=0).long()
    slot = page_table.long().gather(1, (pos // page).unsqueeze(1)).squeeze(1) * page + pos % page
    first = torch.argmax(valid.to(torch.int32)).view(1)  # index_select, not slot[first]: a 0-d index syncs
    any_valid = valid.any()
    slot = torch.where(valid, slot, slot.index_select(0, first))
    slot = torch.where(any_valid, slot, torch.zeros_like(slot))
    rows = torch.where(valid.view(-1, *[1] * (new.dim() - 1)), new, new.index_select(0, first))
    rows = torch.where(any_valid, rows, flat[0].expand_as(rows))
    flat.index_copy_(0, slot, rows.to(flat.dtype))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0,
                            **refused):
    """Decode over a paged cache: q [B, 1, H, D]; k and v [B, 1, Hk, D] (the step's, written at
    cache_seqlens) or None; k_cache, v_cache [pages, page_size, Hk, D]; page_table [B, max_pages]."""
    _refuse(refused)
    if page_table is None or cache_seqlens is None or q.shape[1] != 1:
        raise NotImplementedError("arfusion's FA3 shim: one query per sequence, a page table and cache_seqlens only")
    batch, _, heads, dim = q.shape
    if k is not None:
        write_paged(k_cache, k[:, 0], page_table, cache_seqlens)
        write_paged(v_cache, v[:, 0], page_table, cache_seqlens)
    used = (cache_seqlens + (1 if k is not None else 0)).clamp(min=0).to(torch.int32)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    out = _fwd(q.reshape(batch, heads, dim), k_cache, v_cache, cu_seqlens_q=cu_q, seqused_k=used, max_seqlen_q=1,
               max_seqlen_k=page_table.shape[1] * k_cache.shape[1], page_table=page_table.to(torch.int32),
               softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
               num_splits=num_splits)
    return out.view(batch, 1, heads, -1)
