"""The MoE top-k combine in front of a site's all-reduce, fused into the site's op.

HF's grouped experts end with `(rows * w_g)[inv_perm].view(T, K, H).sum(1)`, and that is what is
all-reduced: `arfusion::moe_combine_allreduce_rmsnorm` takes the permuted rows, the weights and
the index and does combine + all-reduce + residual + RMSNorm (FlashInfer's MoE finalize kernel on
GPUs at decode sizes; here the torch reference, which replays the graph's combine bit for bit).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import arfusion
from arfusion.decisions import Why
from arfusion.edits import fused_calls
from arfusion.fusion_pass import ArFusionPass, ChainedPass

from .models import unfused_all_reduces
from .helpers import assert_close, run_workers
from .sites import NORMS

H, E, K, T = 128, 4, 2, 6
MOE_OP = torch.ops.arfusion.moe_combine_allreduce_rmsnorm.default


class GroupedExperts(nn.Module):
    """A router, one linear per expert run on expert-sorted rows (HF `grouped_mm` layout), the
    top-k combine spelled as `variant` says, the all-reduce, the residual add and Llama's norm."""

    def __init__(self, variant="hf", dtype=torch.bfloat16, shared=None, fp32_weights=False, routed_scale=None,
                 widen_sum=False):
        super().__init__()
        self.widen_sum = widen_sum  # HY-V3: (routed.float() + shared.float()).to(dtype)
        self.routed_scale = routed_scale  # Laguna: AR(routed) * routed_scaling_factor + AR(shared)
        # None | "plain" (DeepSeek: a row-parallel shared expert) | "gated" (Qwen3-Next) |
        # "replicated" (MiniMax-M3: the shared expert is not in the TP plan, added after the all-reduce)
        self.shared = shared
        # DeepSeek's router keeps its weights in fp32: the combine runs in fp32, then `.to(dtype)`.
        self.fp32_weights = fp32_weights
        self.shared_expert = nn.Linear(H, H, bias=False, dtype=dtype)
        self.shared_gate = nn.Linear(H, 1, bias=False, dtype=dtype)
        self.router = nn.Linear(H, E, bias=False, dtype=dtype)
        self.experts = nn.Parameter(0.1 * torch.randn(E, H, H, dtype=dtype))
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))
        self.variant = variant

    def forward(self, x, residual):
        flat = x.reshape(-1, H)
        tokens = flat.shape[0]
        probs = torch.softmax(self.router(flat).float(), -1)
        top_w, top_i = torch.topk(probs, K, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        top_w = top_w if self.fp32_weights else top_w.to(x.dtype)
        ids, weights = top_i.reshape(-1), top_w.reshape(-1)
        ids_g, perm = torch.sort(ids)
        rows = torch.bmm(flat[perm // K].unsqueeze(1), self.experts[ids_g]).squeeze(1)  # [R, H]
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.shape[0])
        extra = ()
        v = self.variant
        if v in ("hf", "weights_first", "gathered_read_elsewhere"):
            w_g = weights[perm].unsqueeze(-1)
            weighted = w_g * rows if v == "weights_first" else rows * w_g
            gathered = weighted[inv_perm]
            out = gathered.view(tokens, K, H).sum(1)
            if v == "gathered_read_elsewhere":
                extra = (gathered * 2,)
        elif v == "gather_then_scale":
            out = (rows[inv_perm] * weights.unsqueeze(-1)).view(tokens, K, H).sum(1)
        elif v == "sum_over_other_dim":  # (k, token) order: a different combine
            out = (rows * weights[perm].unsqueeze(-1))[inv_perm].view(K, tokens, H).sum(0)
        elif v == "weights_after_sum":
            out = rows[inv_perm].view(tokens, K, H).sum(1) * top_w.sum(-1, keepdim=True)
        else:
            raise ValueError(v)
        out = out.to(x.dtype)  # HF's grouped experts return the activation dtype (a no-op unless fp32 weights)
        dist.all_reduce(out)
        out = out.view(x.shape)
        if self.routed_scale is not None:
            out = out * self.routed_scale
        if self.shared:  # all-reduced apart, then added: the pass merges the two all-reduces first
            shared = self.shared_expert(x)
            if self.shared != "replicated":
                dist.all_reduce(shared)
            if self.shared == "gated":
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            wide = torch.float32 if self.widen_sum is True else self.widen_sum
            out = (out.to(wide) + shared.to(wide)).to(out.dtype) if self.widen_sum else out + shared
        h = residual + out
        return (NORMS["hf_llama"][0](h, self.weight, 1e-6), h, *extra)


def compile_run(module, inputs, fuse_moe_combine=True, dynamic=False, backend="torch"):
    """(compiled outputs, eager outputs, stats, {"moe": n, "plain": n, "left": n})."""
    seen = {}

    def inspect(graph):
        ops = [op for _, op in fused_calls(graph)]
        seen.update(moe=ops.count(MOE_OP), plain=len(ops) - ops.count(MOE_OP),
                    left=unfused_all_reduces(graph))

    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend, fuse_moe_combine=fuse_moe_combine)
    arfusion.reset_stats()
    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": ChainedPass([ArFusionPass(config), inspect])}
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        expected = module(*inputs)
        actual = torch.compile(module, options=options, dynamic=dynamic)(*inputs)
    return actual, expected, arfusion.stats(), seen


def _inputs(dtype=torch.bfloat16):
    return torch.randn(1, T, H, dtype=dtype), torch.randn(1, T, H, dtype=dtype)


# ------------------------------------------------------------------ graphs (fake group)


@pytest.mark.parametrize("fp32_weights", [False, True], ids=["bf16_weights", "fp32_weights"])
@pytest.mark.parametrize("variant", ["hf", "weights_first", "gather_then_scale"])
@pytest.mark.slow
def test_combine_is_fused_into_the_site(fake_pg, variant, fp32_weights, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="arfusion"):
        _, _, stats, seen = compile_run(GroupedExperts(variant, fp32_weights=fp32_weights), _inputs())
    assert seen == {"moe": 1, "plain": 0, "left": 0}, seen
    assert stats["fused_sites"] == 1 and stats["moe_combines_fused"] == 1
    assert "MoE top-k combine (K=2) fused" in caplog.text


class AttentionThenExperts(nn.Module):
    """A decoder layer's two sites: a row-parallel output all-reduced, added, normed; then the MoE block."""

    def __init__(self):
        super().__init__()
        self.o_proj = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=torch.bfloat16))
        self.moe = GroupedExperts()

    def forward(self, x, residual):
        attn = self.o_proj(x)
        dist.all_reduce(attn)
        h = residual + attn
        return self.moe(NORMS["hf_llama"][0](h, self.norm_weight, 1e-6), h)


@pytest.mark.parametrize("with_attention", [False, True], ids=["moe_alone", "after_attention"])
@pytest.mark.slow
def test_a_kernel_that_needs_another_collective_gets_the_combine_only_with_one(fake_pg, monkeypatch, with_attention,
                                                                               caplog):
    """FlashInfer's finalize kernel alternates two workspaces; a graph whose only collectives are
    MoE sites, replayed back to back, could start on the workspace it ended on. The pass gives such
    a backend the combine only where the graph has another collective on the group."""
    from dataclasses import replace

    from arfusion.backends import get_backend

    backend = get_backend("torch")
    monkeypatch.setattr(backend, "capabilities",
                        replace(backend.capabilities, moe_combine_needs_other_collective=True))
    torch.manual_seed(0)
    module = AttentionThenExperts() if with_attention else GroupedExperts()
    with caplog.at_level(logging.INFO, logger="arfusion"):
        _, _, stats, seen = compile_run(module, _inputs())
    assert stats["fused_sites"] == 1 + with_attention
    if with_attention:
        assert seen == {"moe": 1, "plain": 1, "left": 0} and stats["moe_combines_fused"] == 1, seen
    else:
        assert seen == {"moe": 0, "plain": 1, "left": 0} and stats["moe_combines_fused"] == 0, seen
        assert "no other collective on group" in caplog.text


@pytest.mark.parametrize("variant, why", [
    ("gathered_read_elsewhere", "read only by"),
    ("sum_over_other_dim", "not over dim 1"),
    ("weights_after_sum", "not a sum"),
])
@pytest.mark.slow
def test_lookalikes_fuse_the_site_alone(fake_pg, variant, why, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.DEBUG, logger="arfusion"):
        _, _, stats, seen = compile_run(GroupedExperts(variant), _inputs())
    assert seen == {"moe": 0, "plain": 1, "left": 0}, seen
    assert stats["fused_sites"] == 1 and stats["moe_combines_fused"] == 0
    assert "no MoE top-k combine fused" in caplog.text and why in caplog.text, caplog.text


@pytest.mark.parametrize("shared, fp32_weights, widen_sum", [
    ("plain", True, False), ("plain", False, False), ("gated", False, False), ("plain", True, True)])
def test_a_shared_expert_goes_into_the_op_with_the_combine(fake_pg, shared, fp32_weights, widen_sum):
    """DeepSeek (fp32 router weights) / Qwen3-Next / HY-V3 (the sum in fp32, cast back):
    AR(combine) + [gate *] AR(shared) -> AR(combine + [gate *] shared): one all-reduce, and the op
    takes the combine's inputs and the shared term (FlashInfer's shared_expert_output)."""
    torch.manual_seed(0)
    model = GroupedExperts(shared=shared, fp32_weights=fp32_weights, widen_sum=widen_sum)
    _, _, stats, seen = compile_run(model, _inputs())
    assert seen == {"moe": 1, "plain": 0, "left": 0}, seen
    assert stats["summed_all_reduces_merged"] == 1 and stats["gated_all_reduces_merged"] == (shared == "gated")
    assert stats["fused_sites"] == 1 and stats["moe_combines_fused"] == 1


def _moe_op_scales(graph) -> list[tuple[float, float]]:
    """(routed_scale, input_scale) of each MoE op in `graph`."""
    return [(n.kwargs.get("routed_scale", 1.0), n.kwargs.get("input_scale", 1.0))
            for n in graph.nodes if n.target is MOE_OP]


@pytest.mark.parametrize("shared, routed_scale, scales", [
    ("plain", 1.0, []),  # Laguna's own default: `* 1.0` is an identity
    ("plain", 2.5, [(2.5, 1.0)]),  # Laguna: AR(routed) * s + AR(shared) -> AR(routed * s + shared)
    ("replicated", 2.5, [(1.0, 2.5)]),  # MiniMax-M3: AR(routed) * s + shared (replicated) + residual
    (None, 0.75, [(1.0, 0.75)]),  # AR(routed) * s + residual
])
def test_a_scaled_combine_goes_into_the_op_with_its_factor(fake_pg, shared, routed_scale, scales):
    """A number scaling the combine, before the all-reduce (after the merge) or after it, goes into
    the MoE op, which hands it to FlashInfer's routed_scaling_factor."""
    torch.manual_seed(0)
    found = []
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
    options = {"post_grad_custom_post_pass": ChainedPass([ArFusionPass(config),
                                                          lambda g: found.extend(_moe_op_scales(g))])}
    model = GroupedExperts(shared=shared, routed_scale=routed_scale)
    arfusion.reset_stats()
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(model, options=options)(*_inputs())
    stats = arfusion.stats()
    assert stats["fused_sites"] == 1 and stats["moe_combines_fused"] == 1, stats
    assert stats["summed_all_reduces_merged"] == (shared == "plain")
    assert found == (scales or [(1.0, 1.0)]), found
    assert stats["scaled_all_reduces_fused"] == sum(1 for _, s in scales if s != 1.0)


def test_a_shared_term_summed_in_float64_keeps_the_combine_out(fake_pg):
    """(combine.double() + shared.double()).to(bf16) rounds differently from the op's bf16 add
    (which computes in fp32): the all-reduces merge, the site fuses, the combine stays Inductor's."""
    torch.manual_seed(0)
    _, _, stats, seen = compile_run(GroupedExperts(shared="plain", widen_sum=torch.float64), _inputs())
    assert stats["summed_all_reduces_merged"] == 1 and stats["fused_sites"] == 1
    assert seen == {"moe": 0, "plain": 1, "left": 0} and stats["moe_combines_fused"] == 0, (seen, stats)


def test_switched_off(fake_pg):
    torch.manual_seed(0)
    _, _, stats, seen = compile_run(GroupedExperts(), _inputs(), fuse_moe_combine=False)
    assert seen == {"moe": 0, "plain": 1, "left": 0} and stats["moe_combines_fused"] == 0


@pytest.mark.slow
def test_dynamic_token_count(fake_pg):
    torch.manual_seed(0)
    _, _, stats, seen = compile_run(GroupedExperts(), _inputs(), dynamic=True)
    assert seen["moe"] == 1 and stats["moe_combines_fused"] == 1


# ------------------------------------------------------------------ real ranks (gloo)


def _tensor_parallel(model, rank):
    """Tensor parallelism's view of the model: its experts' weights are this rank's shards, the
    router and the shared expert's gate the same everywhere (so are the activations)."""
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        model.experts.normal_(0, 0.1)
        model.shared_expert.weight.normal_(0, H ** -0.5)
    return model


def _numerics(rank, dynamic):
    torch.manual_seed(0)  # same weights on every rank
    variants = ("hf",) if dynamic else ("hf", "weights_first", "gather_then_scale")  # time: dynamic once
    models = [GroupedExperts(v) for v in variants] + ([] if dynamic else [
        GroupedExperts(shared="plain"), GroupedExperts(shared="plain", fp32_weights=True, routed_scale=1.0),
        GroupedExperts(shared="plain", routed_scale=2.5), GroupedExperts(routed_scale=0.75),
        GroupedExperts(shared="replicated", routed_scale=2.5),
        GroupedExperts(shared="plain", fp32_weights=True, widen_sum=True),
        GroupedExperts("gather_then_scale", fp32_weights=True)])
    gated = None if dynamic else _tensor_parallel(GroupedExperts(shared="gated"), rank)
    torch.manual_seed(7)
    replicated = _inputs()
    torch.manual_seed(100 + rank)  # different activations per rank: the all-reduce matters
    cases = [(model, _inputs()) for model in models] + ([(gated, replicated)] if gated is not None else [])
    # Inductor keeps the fused weight product in fp32 unless told to round like eager (without
    # it the unfused graph differs from eager by up to 1 bf16 ulp of the combine, 0.02 here); the
    # op replays the combine as eager does, so the bitwise comparison asks Inductor to round alike.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        for model, inputs in cases:
            actual, expected, stats, seen = compile_run(model, inputs, dynamic=dynamic)
            assert seen["moe"] == 1 and stats["moe_combines_fused"] == 1, (model.variant, seen, stats)
            assert stats["dispatch"] == {"torch": 1}, stats
            for a, e in zip(actual, expected):
                assert_close(a, e, torch.bfloat16, model.variant)
            without, _, stats_without, seen_without = compile_run(model, inputs, fuse_moe_combine=False,
                                                                  dynamic=dynamic)
            assert seen_without["moe"] == 0 and seen_without["plain"] == 1
            for a, b in zip(actual, without):
                if model.shared or model.routed_scale not in (None, 1.0):
                    # Inductor fuses `sum + shared` and may add to the unrounded sum, the op rounds the
                    # combine first as the graph says: a rounding apart (both ~0.03 from eager here,
                    # which rounds each all-reduce on its own). A factor after the all-reduce: the plain
                    # op's torch backend scales before it, the MoE op after it, as the graph does.
                    assert_close(a, b, torch.bfloat16, "shared")
                    continue
                assert torch.equal(a, b), (model.variant, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.multiproc
@pytest.mark.slow
def test_fused_combine_matches_eager_and_the_pass_without_it(dynamic):
    run_workers(_numerics, 2, dynamic)


# ------------------------------------------------------------------ a real HF MoE model


def _deepseek_v3(rank):
    import importlib.util
    from pathlib import Path

    from arfusion.hf import tp_kwargs
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    spec = importlib.util.spec_from_file_location(
        "compile_hf_model", Path(__file__).resolve().parents[1] / "examples" / "compile_hf_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # HF's TP reads these
    hf_logging.set_verbosity_error()
    config = example.tiny_config("deepseek_v3", 2, 256, 2)
    config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok = 16, 128, 4  # smaller, faster
    # DeepSeek: every layer MoE (no dense prefix), one expert group, its small MLA shapes.
    config.update(DEEPSEEK_V3)
    path = example.save_random_model(config, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **tp_kwargs("auto", config=path)).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    arfusion.reset_stats()
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))  # as the example does
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        ref = model(input_ids=ids, use_cache=False).logits.float()
        got = torch.compile(model)(input_ids=ids, use_cache=False).logits.float()
    arfusion.disable()
    stats = arfusion.stats()
    # Every site fuses (the embedding's + one per MoE block, + one per attention block where the TP
    # plan shards MLA: transformers >= 5.25), each layer's MoE block takes its combine in, and its
    # separately all-reduced shared expert is merged into it (routed experts sharded by the TP plan,
    # or by expert parallelism over the same ranks: tp_kwargs).
    attention_sites = "layers.*.self_attn.o_proj" in type(config).base_model_tp_plan
    assert stats["fused_sites"] == 1 + 2 * (1 + attention_sites) and stats["unfused_sites"] == 0, stats
    assert stats["moe_combines_fused"] == 2 and stats["summed_all_reduces_merged"] == 2, stats
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 2e-2, rel
    if rank == 0:
        print(f"deepseek_v3: {stats['by_pattern']}, moe_combines_fused {stats['moe_combines_fused']}, "
              f"logits rel diff {rel:.2e}")


DEEPSEEK_V3 = dict(first_k_dense_replace=0, n_routed_experts=16, n_group=1, topk_group=1, n_shared_experts=1,
                   q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                   head_dim=16, num_key_value_heads=4)


# Qwen3-MoE (every site fused, each layer's combine in its op, logits as eager's) is the HF
# coverage sweep's row, a tiny config loaded with its TP plan on two gloo ranks (tests/test_hf_coverage.py);
# DeepSeek-V3 here has every layer MoE and its shared expert's all-reduce merged (the sweep's row: once).
@pytest.mark.multiproc
@pytest.mark.slow
def test_real_hf_moe_model_fuses_every_site_and_its_combines():
    run_workers(_deepseek_v3, 2)


# ------------------------------------------------------------------ FlashInfer path (stand-in, CPU)


def test_flashinfer_dispatch_entry_is_decode_only(monkeypatch, tmp_path):
    from arfusion.backends import flashinfer as fi
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.core import Call, Form

    from .fake_flashinfer import H200, install_fake_flashinfer, remove_fake_flashinfer

    monkeypatch.setenv(dispatch.CACHE_ENV, str(tmp_path / "tuning.json"))
    monkeypatch.setattr(fi, "device_facts", lambda index: H200)
    install_fake_flashinfer()
    try:
        backend = fi.FlashInferBackend()
        cap = dispatch.MOE_FINALIZE_MAX_TOKENS[(9, 2)]

        def call(tokens, world=2, quant="none"):
            site = Form(residual=True, norm="rms", quant=quant, emit_norm=quant == "none")
            return Call(form=site, tokens=tokens, hidden=4096, dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                        world_size=world, device=torch.device("cuda", 0), group_name="tp")

        # Off by default (slower than the compiled combine + fused site in the model), at every size.
        monkeypatch.delenv(dispatch.MOE_FINALIZE_OPT_IN_ENV, raising=False)
        hash_off = dispatch.table_hash()
        for tokens in (1, cap, None):
            assert backend.moe_combine_why_not(call(tokens), 8, None).code is Why.NO_KERNEL
        monkeypatch.setenv(dispatch.MOE_FINALIZE_OPT_IN_ENV, "1")
        assert dispatch.table_hash() != hash_off  # ranks that disagree on the opt-in use no workspace together
        assert backend.moe_combine_why_not(call(cap), 8, cap * 8) is None
        assert backend.moe_combine_why_not(call(None), 8, None) is None  # left to run time
        assert backend.moe_combine_why_not(call(cap + 1), 8, None).code is Why.SIZE_CAP
        assert backend.moe_combine_why_not(call(1, world=4), 8, None).code is Why.NO_TABLE
        assert backend.moe_combine_why_not(call(1, quant="fp8_dynamic"), 8, None).code is Why.QUANT_FORM
        from arfusion.backends.base import Backend

        assert Backend(name="aiter").moe_combine_why_not(call(1), 8, None).code is Why.NO_KERNEL
    finally:
        remove_fake_flashinfer()
        fi._environment_problem.cache_clear()


def _flashinfer_worker(rank):
    from dataclasses import replace

    from arfusion import reference, runtime
    from arfusion.backends import flashinfer as fi
    from arfusion.backends import get_backend
    from arfusion.core import Form

    from . import fake_flashinfer as tfb

    import os

    from arfusion.backends import flashinfer_dispatch as dispatch

    os.environ[dispatch.MOE_FINALIZE_OPT_IN_ENV] = "1"  # this test is about the kernel's call
    calls = tfb.install_fake_flashinfer()
    finalize_calls = []
    tfb.FakeWorkspace.workspace_tensor = property(lambda self: ("workspace of", self.max_token_num, id(self)))

    def trtllm_moe_finalize_allreduce_fusion(*, allreduce_in, residual_in, norm_weight, expanded_idx_to_permuted_idx,
                                             norm_out, residual_out, quant_out, scale_out, workspace_ptrs,
                                             launch_with_pdl, world_rank, world_size, eps, shared_expert_output,
                                             expert_scale_factor, routed_scaling_factor, weight_bias=None):
        idx, s = expanded_idx_to_permuted_idx, expert_scale_factor
        finalize_calls.append(dict(idx_dtype=idx.dtype, idx_shape=tuple(idx.shape), scale_dtype=s.dtype,
                                   scale_shape=tuple(s.shape), rows_shape=tuple(allreduce_in.shape),
                                   workspace=workspace_ptrs, rank=world_rank, world=world_size,
                                   shared=shared_expert_output, routed=routed_scaling_factor, bias=weight_bias,
                                   quant=(quant_out, scale_out), eps=eps))
        assert idx.dtype == torch.int32 and s.dtype == allreduce_in.dtype and idx.is_contiguous()
        combined = (allreduce_in[idx.long()].float() * s.float().unsqueeze(-1)).sum(1)  # [T, H]
        if routed_scaling_factor is not None:  # on the routed sum, before the shared term
            combined = combined * routed_scaling_factor
        if shared_expert_output is not None:  # added before the all-reduce, as the kernel does
            assert shared_expert_output.shape == combined.shape and shared_expert_output.is_contiguous()
            combined = combined + shared_expert_output.float()
        dist.all_reduce(combined)
        h = (combined + residual_in.float()).to(allreduce_in.dtype)
        residual_out.copy_(h)
        norm_out.copy_((reference.rms_normalize(h, eps) * norm_weight.float()).to(h.dtype))

    sys_trtllm = __import__("sys").modules["flashinfer.comm.trtllm_ar"]
    sys_trtllm.trtllm_moe_finalize_allreduce_fusion = trtllm_moe_finalize_allreduce_fusion
    fi.device_facts = lambda index: replace(tfb.H200, uuid=f"GPU-fake-{rank}")
    runtime.device_index = lambda device: 0
    backend = get_backend("flashinfer")
    backend.capabilities = replace(backend.capabilities, device_types=frozenset({"cpu"}))
    backend.unavailable = lambda device: None
    group = dist.group.WORLD.group_name
    site = Form(residual=True, norm="rms")
    sys_modules = __import__("sys").modules
    finalize_workspaces = []
    try:
        # (tokens, scale_first, fused, with_shared, routed_scale, input_scale)
        cases = ((1, True, True, False, 1.0, 1.0), (8, False, True, False, 1.0, 1.0), (32, True, True, False, 1.0, 1.0),
                 (33, True, False, False, 1.0, 1.0), (4, True, True, True, 1.0, 1.0), (40, True, False, True, 1.0, 1.0),
                 (4, True, True, True, 2.5, 1.0), (4, False, True, False, 1.0, 0.75), (4, True, True, True, 2.5, 0.5),
                 (40, True, False, True, 2.5, 0.5))
        for tokens, scale_first, fused, with_shared, routed_scale, input_scale in cases:
            finalize_calls.clear()
            calls["fusion"].clear()
            torch.manual_seed(100 + rank + tokens)
            rows = torch.randn(tokens * 8, 256, dtype=torch.bfloat16)
            index = torch.randperm(tokens * 8)
            scale = torch.rand(tokens * 8, 1, dtype=torch.bfloat16)
            residual = torch.randn(tokens, 256, dtype=torch.bfloat16)
            torch.manual_seed(0)
            weight = (1 + 0.1 * torch.randn(256)).to(torch.bfloat16)
            shared = torch.randn(tokens, 256, dtype=torch.bfloat16) if with_shared else None
            got = torch.ops.arfusion.moe_combine_allreduce_rmsnorm(
                rows=rows, scale=scale, index=index, top_k=8, scale_first=scale_first, residual=residual,
                weight=weight, eps=1e-6, eps_tensor=None, group_name=group, norm="rms", quant="none", quant_scale=None,
                emit_norm=True, backend="flashinfer", shared=shared, routed_scale=routed_scale, input_scale=input_scale)
            want = reference.unfused(reference.moe_combine(rows, scale, index, 8, scale_first, shared, routed_scale),
                                     residual, weight, 1e-6, group, site, None, input_scale)
            for g, w in zip(got, want):
                assert g.shape == w.shape == (tokens, 256)
                # Relative to the largest value: the reference rounds the scaled combine before the
                # shared term and the residual cancel it, the stand-in kernel does not.
                err = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                assert err <= 2e-2, (tokens, routed_scale, input_scale, err)
            if fused:  # the MoE kernel, with int32 [T, K] index and [T, K] weights in bf16
                assert len(finalize_calls) == 1 and not calls["fusion"], (tokens, calls["fusion"])
                c = finalize_calls[0]
                assert c["idx_shape"] == c["scale_shape"] == (tokens, 8) and c["rows_shape"] == (tokens * 8, 256)
                routed = None if routed_scale * input_scale == 1.0 else routed_scale * input_scale
                assert (c["rank"], c["world"], c["routed"], c["bias"], c["quant"]) == (rank, 2, routed, None, (None, None))
                assert (c["shared"] is None) != with_shared  # the shared expert's term as shared_expert_output
                if with_shared:  # the factor after the all-reduce applies to the shared term too
                    assert torch.equal(c["shared"], shared * input_scale if input_scale != 1.0 else shared)
                finalize_workspaces.append(c["workspace"])
            else:  # above the entry: combine in torch, then FlashInfer's plain fused kernel
                assert not finalize_calls and len(calls["fusion"]) == 1 and calls["fusion"][0]["tokens"] == tokens
        # The plain kernel's workspace, then the finalize kernel's own two, sized for the table's cap.
        cap = dispatch.MOE_FINALIZE_MAX_TOKENS[(9, 2)]
        assert [c["max_token_num"] for c in calls["create"]][1:] == [cap, cap]
        plain = backend.workspace(group)
        assert plain.max_token_num > cap
        # Taken in turn, never the plain one: a finalize call's buffers are next re-armed two calls on.
        assert len(set(finalize_workspaces)) == 2 and id(plain) not in {w[2] for w in finalize_workspaces}
        assert all(a != b for a, b in zip(finalize_workspaces, finalize_workspaces[1:]))

        # Making the finalize workspaces fails on every rank: the combine runs in torch, the site
        # keeps FlashInfer's plain kernel, and nobody tries again.
        create = sys_modules["flashinfer.comm"].create_allreduce_fusion_workspace

        def no_finalize_workspace(**kw):
            if kw["max_token_num"] == cap:
                calls["create"].append(kw)
                raise RuntimeError("out of IPC handles")
            return create(**kw)

        sys_modules["flashinfer.comm"].create_allreduce_fusion_workspace = no_finalize_workspace
        backend.close()  # else the new group, of the same ranks, would share the workspaces made above
        other = dist.new_group([0, 1])
        for attempt in range(2):
            finalize_calls.clear()
            calls["fusion"].clear()
            calls["create"].clear()
            torch.manual_seed(rank)
            rows, index = torch.randn(32, 256, dtype=torch.bfloat16), torch.randperm(32)
            scale, residual = torch.rand(32, 1, dtype=torch.bfloat16), torch.randn(4, 256, dtype=torch.bfloat16)
            weight = torch.ones(256, dtype=torch.bfloat16)
            got = torch.ops.arfusion.moe_combine_allreduce_rmsnorm(
                rows=rows, scale=scale, index=index, top_k=8, scale_first=True, residual=residual, weight=weight,
                eps=1e-6, eps_tensor=None, group_name=other.group_name, norm="rms", quant="none", quant_scale=None,
                emit_norm=True, backend="flashinfer")
            want = reference.unfused(reference.moe_combine(rows, scale, index, 8, True), residual, weight, 1e-6,
                                     other.group_name, site)
            assert all(torch.allclose(g.float(), w.float(), atol=0.05, rtol=0.02) for g, w in zip(got, want))
            assert not finalize_calls and len(calls["fusion"]) == 1
            assert len(calls["create"]) == (2 if attempt == 0 else 0)  # plain, then the failed finalize one
        state = backend._groups[other.group_name]
        assert state.failed is None and "out of IPC handles" in state.finalize_failed
    finally:
        backend.close()
        tfb.remove_fake_flashinfer()


@pytest.mark.multiproc
@pytest.mark.slow
def test_flashinfer_moe_finalize_arguments_and_fallback():
    run_workers(_flashinfer_worker, 2, fresh=True)  # it puts stand-ins for flashinfer into sys.modules
