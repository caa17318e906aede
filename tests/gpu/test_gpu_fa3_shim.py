"""benchmarks/flash_attn3 (Flash Attention 3's interface over vLLM's FA3 kernels) on one Hopper GPU,
in this process: what transformers' continuous batching asks of it, against SDPA.

- prefill (`flash_attn_varlen_func`): packed sequences, causal, GQA, head_dim 128, bf16;
- decode (`flash_attn_with_kvcache`): the step's keys and values written into scattered pages, a
  padding row (cache length -1) that writes nothing;
- the decode call captured in a CUDA graph and replayed on new inputs, as transformers does;
- the prefill call inside `torch.compile(fullgraph=True)` (the shim's op has a fake).

Skipped without a CUDA GPU of compute capability 9.x or without the library
(`source benchmarks/device/fa3_setup.sh` sets ARFUSION_FA3_SO).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SHIM = Path(__file__).resolve().parents[2] / "benchmarks" / "flash_attn3"


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"FA3 kernels are built for SM90; this GPU is SM{''.join(map(str, torch.cuda.get_device_capability()))}"
    library = os.environ.get("ARFUSION_FA3_SO") or str(SHIM / "_vllm_fa3_C.abi3.so")
    if not Path(library).exists():
        return f"no FA3 library at {library} (benchmarks/device/fa3_setup.sh)"
    return None


MISSING = _missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
PAGE, HEADS, KV_HEADS, DIM = 16, 8, 2, 128


@pytest.fixture(scope="module")
def fa3():
    sys.path.insert(0, str(SHIM))
    try:
        import flash_attn_interface
        yield flash_attn_interface
    finally:
        sys.path.remove(str(SHIM))


def reference(q, keys, values, causal=True):
    """SDPA for one sequence: q [Sq, H, D], keys and values [Sk, Hk, D]; queries are the last Sq positions."""
    sq, sk = q.shape[0], keys.shape[0]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        mask = torch.arange(sk, device=q.device)[None] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), keys.transpose(0, 1).float(),
                                         values.transpose(0, 1).float(), attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


def test_prefill_packed_sequences(fa3):
    torch.manual_seed(0)
    lengths = [5, 130, 1, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).unbind(0)
    out = fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    for b in range(len(lengths)):
        s, e = cu[b].item(), cu[b + 1].item()
        torch.testing.assert_close(out[s:e], reference(q[s:e], k[s:e], v[s:e]), atol=2e-2, rtol=2e-2)


def _decode_inputs(batch, past, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = torch.randn(2, batch, 1, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g).unbind(0)
    return q, k, v, torch.tensor(past, dtype=torch.int32, device="cuda")


def _decode_reference(q, k_cache, v_cache, table, past):
    """Each row's attention over its pages up to and with the step (caches already written)."""
    outs = []
    for b, p in enumerate(past):
        if p < 0:
            outs.append(None)
            continue
        slots = [page * PAGE + s for page in table[b].tolist() if page >= 0 for s in range(PAGE)][:p + 1]
        keys, values = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        outs.append(reference(q[b], keys, values))
    return outs


def test_decode_writes_the_step_and_attends_over_scattered_pages(fa3):
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 64, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).unbind(0)
    table = torch.tensor([[7, -1, -1, -1], [3, 40, 12, -1], [-1, -1, -1, -1], [60, 0, 33, 9]], dtype=torch.int32,
                         device="cuda")
    past = [0, 40, -1, 63]
    q, k, v, seqlens = _decode_inputs(4, past, seed=2)
    before = k_cache.clone()
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, page_table=table, causal=True)
    changed = (k_cache != before).flatten(0, 1).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == sorted([7 * PAGE + 0, 12 * PAGE + 8, 9 * PAGE + 15])  # rows 0, 1, 3; none for the padding row
    for b, want in enumerate(_decode_reference(q, k_cache, v_cache, table, past)):
        if want is not None:
            torch.testing.assert_close(out[b], want, atol=2e-2, rtol=2e-2)


def test_decode_captured_in_a_cuda_graph_replays_on_new_inputs(fa3):
    k_cache, v_cache = torch.zeros(2, 32, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).unbind(0)
    k_cache.normal_(), v_cache.normal_()
    table = torch.arange(32, dtype=torch.int32, device="cuda").view(4, 8)
    q, k, v, seqlens = _decode_inputs(4, [3, 20, 100, 5], seed=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up, as transformers runs the step once before capturing
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, page_table=table, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, page_table=table,
                                          causal=True)
    past = [10, -1, 127, 64]
    nq, nk, nv, nseq = _decode_inputs(4, past, seed=4)
    for mine, new in ((q, nq), (k, nk), (v, nv), (seqlens, nseq)):
        mine.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    for b, want in enumerate(_decode_reference(q, k_cache, v_cache, table, past)):
        if want is not None:
            assert torch.equal(k_cache.flatten(0, 1)[table[b, past[b] // PAGE] * PAGE + past[b] % PAGE], nk[b, 0])
            torch.testing.assert_close(out[b], want, atol=2e-2, rtol=2e-2)


def test_prefill_compiles_whole(fa3):
    torch.manual_seed(5)
    lengths = [17, 40]
    cu = torch.tensor([0, 17, 57], dtype=torch.int32, device="cuda")
    q = torch.randn(57, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 57, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).unbind(0)

    def attention(q, k, v):
        return fa3.flash_attn_varlen_func(q * 1.0, k, v, cu, cu, max(lengths), max(lengths), causal=True) + 0.0

    torch._dynamo.reset()
    out = torch.compile(attention, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, fa3.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True))
