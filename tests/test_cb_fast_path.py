"""transformers' continuous-batching decode fast path (Flash Attention's paged kernel
`flash_attn_with_kvcache` on a block table) with the pass, on CPU: a stand-in kernel
(tests/fake_flash_attn.py) and transformers' checks told that Flash Attention 2 is there.

What transformers 5.24 needs to take the path (`ensure_decode_fast_path_is_available`,
`lazy_import_flash_attention`): an attention implementation named Flash Attention 2 or 3, CUDA (or
XPU for FA2), a `flash_attn` package it accepts (`is_flash_attn_2_available`: the flash-attn
distribution, >= 2.3.3, on CUDA) with `flash_attn_with_kvcache`, and attention types that all
support block tables. The fixture below meets each on CPU with as little as it can.

Without arfusion's fix every decode-step site split at two graph breaks per attention call (the
cache update's and the kernel's `torch.compiler.disable`); with it (arfusion.hf.paged_cache) every
site fuses on both paths, with the tokens of the eager run. One process, a fake world of 2 ranks,
a tiny fp32 Llama, a cache of 64 blocks.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
initialization = pytest.importorskip("transformers.generation.continuous_batching.initialization")
if not hasattr(initialization, "ensure_decode_fast_path_is_available"):
    pytest.skip("this transformers has no decode fast path check", allow_module_level=True)

import transformers.integrations.flash_attention as flash_integration  # noqa: E402
import transformers.modeling_flash_attention_utils as flash_utils  # noqa: E402

import arfusion  # noqa: E402
from arfusion import hf  # noqa: E402
from arfusion.check import load_tp_model, save_random_model  # noqa: E402
from arfusion.hf import paged_cache  # noqa: E402
from arfusion.hf.configs import tiny_config  # noqa: E402
from arfusion.hf.continuous_batching import decode_fast_path  # noqa: E402
from arfusion.testing import assert_fused, fake_world, generate_batch  # noqa: E402

from . import fake_flash_attn  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
NEW_TOKENS = 6
LAYERS = 2
PASS = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
# transformers' lazily loaded Flash Attention functions, restored after each test.
LOADED = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn",
          "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama at TP=2 over a fake world (prepared for compile: load_tp_model)."""
    with fake_world(2), tempfile.TemporaryDirectory() as path:
        save_random_model(tiny_config("llama"), path, dtype=torch.float32)
        yield load_tp_model(path, 2, dtype=torch.float32)


SHIM = Path(__file__).resolve().parents[1] / "benchmarks" / "flash_attn3"


class _CudaSaysYes:
    """`torch` for transformers' decode-fast-path check alone: CUDA "available" (FA3 has no XPU path)."""
    cuda = types.SimpleNamespace(is_available=lambda: True)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _switcher(monkeypatch, implementation: str, calls):
    """Gives switch(model), which sets `model`'s attention implementation and returns the kernel's
    call log; at exit every switched model gets its own back (and, by monkeypatch, transformers its
    lazily loaded Flash Attention functions)."""
    for name in LOADED:
        monkeypatch.setattr(flash_utils, name, getattr(flash_utils, name))
    # fp32 activations: transformers casts them to the linears' dtype (fp32 here, a no-op) and logs
    # a warning_once, a graph break of its own; bf16/fp16 models never take that branch.
    monkeypatch.setattr(flash_integration, "get_target_dtype", lambda query, module: None)
    switched = []

    def switch(model):
        switched.append((model.config, model.config._attn_implementation))
        model.config._attn_implementation_internal = implementation  # set_attn_implementation checks CUDA
        return calls

    yield switch
    for config, original in switched:
        config._attn_implementation_internal = original


@pytest.fixture
def flash_attention_2(monkeypatch):
    """Switches a model to transformers' Flash Attention 2 path with the stand-in kernel; returns the
    stand-in's call log. Undone after the test."""
    calls = fake_flash_attn.install_fake_flash_attn()
    # transformers' package check: the flash-attn distribution (>= 2.3.3) on CUDA.
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *a, **k: True)
    # Its device check: FA2/3 on CUDA or FA2 on XPU. The XPU name, not torch.cuda.is_available,
    # which would send the rest of the run down CUDA code.
    monkeypatch.setattr(initialization, "is_torch_xpu_available", lambda *a, **k: True)
    with _switcher(monkeypatch, "flash_attention_2", calls) as switch:
        yield switch
    fake_flash_attn.remove_fake_flash_attn()


@pytest.fixture
def flash_attention_3(monkeypatch):
    """The same with Flash Attention 3: benchmarks/flash_attn3's interface (what the GPU benchmarks
    load over vLLM's FA3 kernels) over a CPU stand-in of the op it calls, `_vllm_fa3_C::fwd`."""
    calls = fake_flash_attn.register_fake_fa3()
    monkeypatch.syspath_prepend(str(SHIM))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(flash_utils, "is_flash_attn_3_available", lambda *a, **k: True)
    monkeypatch.setattr(initialization, "torch", _CudaSaysYes())  # its one CUDA question, in that check alone
    with _switcher(monkeypatch, "flash_attention_3", calls) as switch:
        yield switch


@pytest.fixture
def prepared():
    hf.release_paged_cache()
    hf.keep_paged_cache_in_graph()
    yield
    hf.release_paged_cache()
    hf.keep_paged_cache_in_graph()  # as load_tp_model left it, for the module's next test


def test_the_stand_in_computes_attention():
    """The stand-in against SDPA: a paged cache with scattered pages, GQA, three lengths; and the
    varlen call on packed sequences."""
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 8
    lengths = [1, 6, 9]  # cached tokens before this step
    k_cache, v_cache = torch.randn(2, 16, page, kv_heads, dim).unbind(0)
    block_table = torch.tensor([[5, -1, -1], [2, 9, -1], [12, 0, 7]], dtype=torch.int32)
    q, k, v = torch.randn(3, 1, heads, dim), torch.randn(3, 1, kv_heads, dim), torch.randn(3, 1, kv_heads, dim)
    before = k_cache.clone()
    out = fake_flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=block_table,
                                                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=True)
    for b, past in enumerate(lengths):
        slots = [(p * page + s) for p in block_table[b].tolist() if p >= 0 for s in range(page)][:past + 1]
        keys, values = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        assert torch.equal(keys[-1], k[b, 0]) and torch.equal(values[-1], v[b, 0])
        assert torch.equal(keys[:-1], before.flatten(0, 1)[slots[:-1]])
        want = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                              enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[b], want)
    packed_q, packed_kv = torch.randn(12, heads, dim), torch.randn(2, 12, kv_heads, dim)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = fake_flash_attn.flash_attn_varlen_func(packed_q, *packed_kv, cu, cu, 7, 7, causal=True)
    for start, end in ((0, 5), (5, 12)):
        want = F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1) for x in (packed_q, *packed_kv)),
                                              is_causal=True, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[start:end], want)


def test_transformers_takes_the_fast_path_with_the_eager_tokens(llama, flash_attention_2, prepared):
    """Each decode step calls the paged kernel once per layer; the tokens are the default path's.
    The first cache made swaps transformers' kernel wrapper for arfusion's; release undoes it."""
    default = generate_batch(llama, PROMPTS, NEW_TOKENS, compiled=False)
    calls = flash_attention_2(llama)
    assert decode_fast_path(llama)
    eager = generate_batch(llama, PROMPTS, NEW_TOKENS, compiled=False)
    assert dict(calls) == {"flash_attn_varlen_func": LAYERS, "flash_attn_with_kvcache": (NEW_TOKENS - 1) * LAYERS}
    assert eager.tokens == default.tokens
    assert flash_utils._flash_with_kvcache_fn._arfusion_disabled is not None
    hf.release_paged_cache()
    assert getattr(flash_utils._flash_with_kvcache_fn, "_torchdynamo_disable", False)


@pytest.mark.parametrize("flash", ["flash_attention_2", "flash_attention_3"])
def test_every_site_fuses_on_the_fast_path_as_on_the_default_path(llama, flash, request, prepared):
    """Every graph is whole and has its 5 sites fused, however many the run compiles: here one, but a
    recompile for new shapes makes two (CI on torch 2.11 saw it once; examples/serve_continuous_batching.py's
    8 requests always make two). Flash Attention 3 through the benchmarks' shim the same."""
    default = generate_batch(llama, PROMPTS, NEW_TOKENS, config=PASS)
    assert default.report.graphs >= 1 and not default.report.stats["split_by_graph_breaks"], default.report
    assert default.report.all_reduces == 5 * default.report.graphs, default.report
    assert_fused(default.report, left=0)
    torch._dynamo.reset()
    calls = request.getfixturevalue(flash)(llama)
    eager = generate_batch(llama, PROMPTS, NEW_TOKENS, compiled=False)
    calls.clear()
    run = generate_batch(llama, PROMPTS, NEW_TOKENS, config=PASS)
    # The varlen graph and the decode graphs (one per batch size before dynamic shapes).
    decode_calls = calls["flash_attn_with_kvcache"] if flash == "flash_attention_2" else calls["_vllm_fa3_C::fwd"]
    assert decode_calls >= (NEW_TOKENS - 1) * LAYERS, calls
    assert any(paged_cache.FLASH_OP in line for line in eager.report.log), eager.report.log  # its first cache
    assert run.report.graphs >= 2 and not run.report.stats["split_by_graph_breaks"], run.report
    assert run.report.all_reduces == 5 * run.report.graphs, run.report
    assert_fused(run.report, left=0)
    assert run.tokens == eager.tokens == default.tokens


class _HostReads(TorchDispatchMode):
    """The ops that read a device value on the host: a CUDA graph capture fails at each."""

    READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
             "aten.is_nonzero.default"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_fa3_shim_writes_the_step_and_attends_over_its_pages(monkeypatch):
    """benchmarks/flash_attn3's decode call against SDPA: scattered pages, GQA, a padding row (cache
    length -1) that writes and reads nothing, no value read on the host (transformers captures the
    call in a CUDA graph; a 0-d tensor index did, and the first GPU run's capture failed); its
    dist-info gives transformers the name it checks."""
    fake_flash_attn.register_fake_fa3()
    monkeypatch.syspath_prepend(str(SHIM))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    import flash_attn_interface as fa3

    assert "flash_attn_3" in importlib.metadata.packages_distributions()["flash_attn_interface"]
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 8
    lengths = [1, 6, -1, 9]
    k_cache, v_cache = torch.randn(2, 16, page, kv_heads, dim).unbind(0)
    table = torch.tensor([[5, -1, -1], [2, 9, -1], [-1, -1, -1], [12, 0, 7]], dtype=torch.int32)
    q, k, v = torch.randn(4, 1, heads, dim), torch.randn(4, 1, kv_heads, dim), torch.randn(4, 1, kv_heads, dim)
    before = k_cache.clone()
    with _HostReads() as reads:
        out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, page_table=table, causal=True,
                                          cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    assert reads.seen == []
    written = (k_cache != before).flatten(0, 1).flatten(1).any(1).nonzero().flatten().tolist()
    assert written == [5 * page + 1, 7 * page + 1, 9 * page + 2]  # rows 0, 3, 1; none for the padding row
    for b, past in enumerate(lengths):
        if past < 0:
            continue
        slots = [p * page + s for p in table[b].tolist() if p >= 0 for s in range(page)][:past + 1]
        keys, values = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        assert torch.equal(keys[-1], k[b, 0]) and torch.equal(values[-1], v[b, 0])
        want = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                              enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[b], want)
    # Batched calls (transformers' non-paged path) go to the varlen kernels, vLLM's build has no other.
    q2, k2, v2 = torch.randn(2, 3, heads, dim), torch.randn(2, 5, kv_heads, dim), torch.randn(2, 5, kv_heads, dim)
    got = fa3.flash_attn_func(q2, k2, v2, causal=True)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)  # bottom-right aligned
    want = F.scaled_dot_product_attention(q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), attn_mask=mask,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want)
    assert fake_flash_attn.CALLS["_vllm_fa3_C::fwd"] == 2
    with pytest.raises(NotImplementedError, match="rotary_cos not supported"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.zeros(4, dtype=torch.int32),
                                    page_table=table, rotary_cos=torch.zeros(1))


def test_the_kernels_own_graph_break_splits_the_decode_sites(llama, flash_attention_2, prepared, monkeypatch):
    """With transformers' compiled-out kernel left in place, the decode graphs split at it (and only
    at it: the cache update is traced) and none of their sites fuses, named in the report; the
    varlen graphs still fuse."""
    monkeypatch.setattr(paged_cache, "_keep_flash_kvcache_in_graph", lambda: None)
    flash_attention_2(llama)
    run = generate_batch(llama, PROMPTS[:1], 2, config=PASS)
    splits = run.report.stats["split_by_graph_breaks"]
    assert set(splits) == {"flash_attn_with_kvcache"}, run.report
    # Varlen graphs (warm-up and prefill shapes) whole, decode graphs in pieces.
    assert run.report.fused >= 5 and run.report.fused % 5 == 0, run.report
    assert run.report.all_reduces - run.report.fused == splits["flash_attn_with_kvcache"] >= 3, run.report


def test_the_op_refuses_tensors_that_are_not_a_prepared_cache():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="not a paged KV cache"):
        torch.ops.arfusion.hf_paged_flash_kvcache(q, torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), None, None, [],
                                                  "", True, None, None, None, None, None, None, None, "unknown")
