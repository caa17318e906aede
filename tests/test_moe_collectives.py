"""MoE blocks: sums of all-reduces become all-reduces of sums, then ordinary sites.

- DeepSeek-V2/V3, GLM-4-MoE, dots1 ...: AR(routed [T, H]).view(B, S, H) + AR(shared) + residual
  -> norm: one all-reduce fewer per layer, and the site fuses;
- Llama-4: AR(expert rows [E*T, H]).view(E, T, H).sum(0) -> AR(rows.view(E, T, H).sum(0)).
Graphs compile against the fake process group; numerics run on two gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import arfusion

from .helpers import assert_close, compiled_vs_eager, run_workers
from .sites import NORMS, assert_matches_eager, run

H = 256
E = 4


class RoutedPlusShared(nn.Module):
    """DeepSeek-style end of an MoE layer (`terms` all-reduced outputs summed, then the residual)."""

    def __init__(self, terms=2, dtype=torch.bfloat16, groups=None, shared_read_elsewhere=False, widen=False,
                 residual_first=False):
        super().__init__()
        self.widen = widen  # HY-V3: (routed.float() + shared.float()).to(dtype)
        self.residual_first = residual_first  # LongCat-Flash: residual + mlp_out + shortcut_moe_out
        self.experts = nn.ModuleList(nn.Linear(H, H, bias=False, dtype=dtype) for _ in range(terms))
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))
        self.groups = groups or [None] * terms
        self.shared_read_elsewhere = shared_read_elsewhere

    def forward(self, x, residual):
        total, outs = None, []
        for i, (expert, group) in enumerate(zip(self.experts, self.groups)):
            y = expert(x.reshape(-1, H) if i == 0 else x)  # routed experts work on [T, H]
            dist.all_reduce(y, group=group)
            y = y.view(x.shape)
            outs.append(y)
            total = y if total is None else (total.float() + y.float()).to(y.dtype) if self.widen else total + y
        h = residual + outs[1] + outs[0] if self.residual_first else residual + total
        normed = NORMS["hf_llama"][0](h, self.weight, 1e-6)
        return (normed, h, outs[1] * 2) if self.shared_read_elsewhere else (normed, h)


class ExpertRowsSummed(nn.Module):
    """Llama-4-style: the [E * T, H] expert rows are all-reduced, then summed over the experts."""

    def __init__(self, dtype=torch.bfloat16, sum_dtype=None):
        super().__init__()
        self.experts = nn.Linear(H, H, bias=False, dtype=dtype)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))
        self.sum_dtype = sum_dtype

    def forward(self, x, residual):
        rows = self.experts(x.reshape(-1, H).repeat(E, 1))  # [E * T, H]
        dist.all_reduce(rows)
        combined = rows.view(E, -1, H).sum(0, dtype=self.sum_dtype).to(x.dtype)
        h = residual + combined.view(x.shape)
        return NORMS["hf_llama"][0](h, self.weight, 1e-6), h


class ReplicatedSharedExpert(nn.Module):
    """Qwen2-MoE / Hunyuan / Solar-Open: the shared expert is not in the TP plan, so its output is
    replicated and added after the routed all-reduce ([T, H]), then viewed back, then the
    residual. gated: Qwen3-Next / Qwen3.5-MoE all-reduce the shared expert too and scale it by a
    replicated sigmoid gate first."""

    def __init__(self, gated=False, dtype=torch.bfloat16, residual=True, routed_scale=None, sum_scale=None):
        super().__init__()
        self.residual, self.routed_scale = residual, routed_scale  # MiniMax-M3: routed * f + shared
        # Granite-4 (granitemoehybrid): (routed + shared) * residual_multiplier; "view first": the
        # routed rows viewed back to [B, S, H] before the sum, which is scaled directly (HF's order)
        self.sum_scale = sum_scale
        self.routed = nn.Linear(H, H, bias=False, dtype=dtype)
        self.shared = nn.Linear(H, H, bias=False, dtype=dtype)
        self.gate = nn.Linear(H, 1, bias=False, dtype=dtype)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))
        self.gated = gated

    def forward(self, x, residual):
        flat = x.reshape(-1, H)
        routed = self.routed(flat)
        dist.all_reduce(routed)
        if self.routed_scale is not None:
            routed = routed * self.routed_scale
        shared = self.shared(flat)
        if self.gated:
            dist.all_reduce(shared)
            shared = torch.sigmoid(self.gate(flat)) * shared
        if isinstance(self.sum_scale, tuple):  # ("view first", f)
            h = (routed.view(x.shape) + shared.view(x.shape)) * self.sum_scale[1]
        else:
            h = (routed + shared).view(x.shape)
            if self.sum_scale is not None:
                h = h * self.sum_scale
        h = residual + h if self.residual else h
        return NORMS["hf_llama"][0](h, self.weight, 1e-6), h


def test_a_replicated_term_added_after_the_all_reduce_folds_into_the_residual(fake_pg):
    fused, left, actual, expected, stats = run(ReplicatedSharedExpert())
    assert len(fused) == 1 and stats["fused_sites"] == 1 and left == 0
    for a, e in zip(actual, expected):  # the terms are summed in another order: within their rounding
        assert_close(a, e, torch.bfloat16, "folded")


def test_a_scaled_all_reduce_with_a_replicated_term_fuses(fake_pg):
    """MiniMax-M3: AR(routed) * routed_scaling_factor + shared (replicated; Inductor puts the sum in
    the shared expert's addmm) -> the site of the product, the factor in the op, shared a term."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(ReplicatedSharedExpert(routed_scale=2.5))
    assert len(fused) == 1 and left == 0 and stats["scaled_all_reduces_fused"] == 1, stats
    assert fused[0]["input_scale"] == 2.5
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "scaled + replicated")


@pytest.mark.parametrize("gated, sum_scale", [(False, 0.22), (False, ("view first", 0.22)), (True, 0.22)])
def test_a_scaled_sum_with_a_replicated_term_is_split_and_fuses(fake_pg, gated, sum_scale):
    """Granite-4: residual + (AR(routed) + shared) * 0.22 -> AR(routed) * 0.22 + shared * 0.22 +
    residual: the site of the scaled all-reduce, the factor in the op. Gated (Qwen3-Next's shape
    scaled): the two all-reduces merge first, then the merged one is scaled alone already."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(ReplicatedSharedExpert(gated=gated, sum_scale=sum_scale))
    assert len(fused) == 1 and left == 0 and stats["scaled_all_reduces_fused"] == 1, stats
    assert fused[0]["input_scale"] == 0.22 and stats["scaled_sums_distributed"] == (not gated), stats
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "scaled sum")


def test_a_gated_all_reduced_term_merges_into_one_all_reduce(fake_pg):
    """Qwen3-Next: AR(routed) + sigmoid(x W_g) * AR(shared) -> AR(routed + sigmoid(x W_g) * shared):
    the sum goes into the residual stream, so the gate is the same on every rank."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(ReplicatedSharedExpert(gated=True))
    assert left == 0 and len(fused) == 1 and stats["fused_sites"] == 1
    assert stats["summed_all_reduces_merged"] == 1 and stats["gated_all_reduces_merged"] == 1
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "gated")


def test_a_gated_sum_that_is_not_added_to_a_residual_keeps_both_all_reduces(fake_pg):
    """Without the residual add nothing says the gate is replicated: two all-reduces stay."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(ReplicatedSharedExpert(gated=True, residual=False))
    assert stats["summed_all_reduces_merged"] == 0 and left + len(fused) == 2
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "gated, no residual")


def test_routed_plus_shared_becomes_one_all_reduce_and_fuses(fake_pg):
    fused, left, actual, expected, stats = run(RoutedPlusShared())
    assert left == 0 and len(fused) == 1 and fused[0]["residual"] is not None  # the residual is the op's
    assert stats["summed_all_reduces_merged"] == 1 and stats["fused_sites"] == 1
    assert_matches_eager(actual, expected)


def test_a_residual_first_sum_on_two_groups_is_left_as_it_was():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([0, 1, 2, 3])]
        fused, left, actual, expected, stats = run(RoutedPlusShared(groups=groups, residual_first=True))
        assert stats["summed_all_reduces_merged"] == 0 and left + len(fused) == 2
        assert_matches_eager(actual, expected)  # the adds kept their order: the same bits
    finally:
        dist.destroy_process_group()


def test_a_residual_first_sum_that_does_not_merge_keeps_its_order(fake_pg, monkeypatch):
    """Regrouped, then the merge declines (as it does for a size it cannot name): the adds are put
    back in the model's order and the routed all-reduce's site fuses as it would have."""
    from arfusion.patterns import collectives, reduced

    regrouped = []  # sums of two all-reduced terms: only the regrouping makes one in this model

    def decline(graph, add):
        regrouped.append(all(isinstance(a, torch.fx.Node) and reduced.reduced_term(a) is not None for a in add.args))
        return None

    monkeypatch.setattr(collectives, "_merge_sum_of_two", decline)
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(RoutedPlusShared(residual_first=True))
    assert any(regrouped) and stats["summed_all_reduces_merged"] == 0 and left + len(fused) == 2
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("shape", ["widen", "residual_first"])
def test_other_spellings_of_two_summed_all_reduces_become_one(fake_pg, shape):
    """HY-V3 (widen): (AR(routed).float() + AR(shared).float()).to(bf16) -> AR((routed.float() +
    shared.float()).to(bf16)): the same sum and rounding, per rank, before the reduction.
    LongCat-Flash (residual_first): (residual + AR(mlp)) + AR(moe) -> residual + AR(mlp + moe),
    one all-reduce fewer; the two sums are taken in another order, so within their rounding."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(RoutedPlusShared(**{shape: True}))
    assert left == 0 and len(fused) == 1 and fused[0]["residual"] is not None  # the residual is the op's
    assert stats["summed_all_reduces_merged"] == 1 and stats["fused_sites"] == 1
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, shape)


def test_three_all_reduces_summed_become_one(fake_pg):
    fused, left, _, _, stats = run(RoutedPlusShared(terms=3))
    assert left == 0 and len(fused) == 1 and stats["summed_all_reduces_merged"] == 2


def test_expert_rows_are_summed_before_the_all_reduce(fake_pg):
    fused, left, actual, expected, stats = run(ExpertRowsSummed())
    assert left == 0 and len(fused) == 1 and stats["sums_moved_before_all_reduce"] == 1
    assert_matches_eager(actual, expected)


def test_all_reduces_on_different_groups_are_not_merged():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([0, 1, 2, 3])]
        fused, left, _, _, stats = run(RoutedPlusShared(groups=groups))
        assert stats["summed_all_reduces_merged"] == 0 and left + len(fused) == 2
    finally:
        dist.destroy_process_group()


def test_all_reduces_on_two_groups_of_the_same_ranks_are_merged(fake_pg):
    """transformers >= 5.25 all-reduces the routed experts over its expert-parallel group and the
    shared expert over its TP group: two groups of the same ranks, so their sum is one all-reduce."""
    fused, left, actual, expected, stats = run(RoutedPlusShared(groups=[dist.new_group([0, 1]), fake_pg]))
    assert left == 0 and len(fused) == 1 and stats["summed_all_reduces_merged"] == 1
    assert_matches_eager(actual, expected)


def test_an_all_reduce_read_elsewhere_is_not_merged(fake_pg):
    fused, left, actual, expected, stats = run(RoutedPlusShared(shared_read_elsewhere=True))
    # Not merged; the routed all-reduce's site still fuses, the shared one's value a term of it.
    assert stats["summed_all_reduces_merged"] == 0 and left == 1 and len(fused) == 1
    for a, e in zip(actual, expected):  # terms summed in another order: within their rounding
        assert_close(a, e, torch.bfloat16, "read elsewhere")


class DenseExperts(nn.Module):
    """A dense MoE written by hand and parallelized per expert (torch's RowwiseParallel on each
    expert's down projection, as a plain per-expert TP plan does): every expert's output is
    all-reduced, then weighted by the replicated top-k gate and summed, in one of the spellings
    people write. All of them compute one function: one all-reduce of the gated sum suffices."""

    SPELLINGS = ("loop_from_zero", "python_sum", "zeros_inplace", "first_plus_rest", "stack_sum", "einsum")

    def __init__(self, spelling, residual=True, dtype=torch.bfloat16, experts=E, top_k=2):
        super().__init__()
        self.spelling, self.residual, self.top_k = spelling, residual, top_k
        self.router = nn.Linear(H, experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(nn.Linear(H, H, bias=False, dtype=dtype) for _ in range(experts))
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))

    def _expert(self, i, x):
        y = self.experts[i](x)
        dist.all_reduce(y)
        return y

    def forward(self, x, residual):
        probs = self.router(x).softmax(-1)
        top, index = probs.topk(self.top_k, -1)
        gate = torch.zeros_like(probs).scatter(-1, index, top)
        n = len(self.experts)
        if self.spelling in ("stack_sum", "einsum"):
            stacked = torch.stack([self._expert(i, x) for i in range(n)], -2)  # [..., E, H]
            out = (stacked * gate.unsqueeze(-1)).sum(-2) if self.spelling == "stack_sum" \
                else torch.einsum("bte,bteh->bth", gate, stacked)
        else:
            terms = [gate[..., i:i + 1] * self._expert(i, x) for i in range(n)]
            if self.spelling == "python_sum":
                out = sum(terms)
            elif self.spelling == "zeros_inplace":
                out = torch.zeros_like(x)
                for t in terms:
                    out += t
            else:
                out = 0 if self.spelling == "loop_from_zero" else terms.pop(0)
                for t in terms:
                    out = out + t
        h = residual + out if self.residual else out
        return NORMS["hf_llama"][0](h, self.weight, 1e-6), h


@pytest.mark.parametrize("spelling", DenseExperts.SPELLINGS)
def test_a_dense_moe_with_an_all_reduce_per_expert_needs_one(fake_pg, spelling):
    """E all-reduced experts, gated and summed however it is spelled -> one all-reduce of the gated
    sum, then the site: the zero a Python sum starts from is dropped, a stack of all-reduces is
    one all-reduce of the stack, and the weighted sum over the experts (a product and a sum, or
    an einsum's bmm) moves before it."""
    fused, left, actual, expected, stats = run(DenseExperts(spelling))
    assert left == 0 and len(fused) == 1 and stats["fused_sites"] == 1, stats
    if spelling in ("stack_sum", "einsum"):
        assert stats["concatenated_all_reduces_merged"] == E - 1
        assert stats["sums_moved_before_all_reduce" if spelling == "stack_sum"
                     else "matmuls_moved_before_all_reduce"] == 1
    else:
        assert stats["summed_all_reduces_merged"] == stats["gated_all_reduces_merged"] == E - 1
    for a, e in zip(actual, expected):  # gated terms summed per rank, then reduced: within rounding
        assert_close(a, e, torch.bfloat16, spelling)


@pytest.mark.parametrize("spelling", ["stack_sum", "einsum"])
def test_a_gated_sum_not_into_a_residual_keeps_its_gate_after_the_all_reduce(fake_pg, spelling):
    """Without an add after the weighted sum nothing says the gate is the same on every rank: the
    stack still becomes one all-reduce (the same values), but the gate and the sum stay after it."""
    fused, left, actual, expected, stats = run(DenseExperts(spelling, residual=False))
    assert stats["sums_moved_before_all_reduce"] == stats["matmuls_moved_before_all_reduce"] == 0
    assert stats["concatenated_all_reduces_merged"] == E - 1 and left + len(fused) == 1
    for a, e in zip(actual, expected):  # Inductor's own order of the gated sum: within its rounding
        assert_close(a, e, torch.bfloat16, spelling)


# ------------------------------------------------------------------ real ranks


def _tensor_parallel_gated_expert(rank):
    """The gated model as tensor parallelism runs it: the same activations and gate on every rank,
    the experts' weights this rank's shards (a gate that differed per rank would not be TP)."""
    torch.manual_seed(0)
    model = ReplicatedSharedExpert(gated=True)
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        for expert in (model.routed, model.shared):
            expert.weight.normal_(0, H ** -0.5)
    torch.manual_seed(7)
    return model, (torch.randn(1, 6, H, dtype=torch.bfloat16), torch.randn(1, 6, H, dtype=torch.bfloat16))


def _tensor_parallel_dense_experts(rank, spelling):
    """Same router, activations and residual on every rank (so the same gate), expert shards per rank."""
    torch.manual_seed(0)
    model = DenseExperts(spelling)
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        for expert in model.experts:
            expert.weight.normal_(0, H ** -0.5)
    torch.manual_seed(7)
    return model, (torch.randn(1, 6, H, dtype=torch.bfloat16), torch.randn(1, 6, H, dtype=torch.bfloat16))


def _moe_ends(rank, dynamic):
    torch.manual_seed(0)  # same weights on every rank
    models = [RoutedPlusShared(), RoutedPlusShared(terms=3), RoutedPlusShared(widen=True),
              RoutedPlusShared(residual_first=True), ExpertRowsSummed(),
              ExpertRowsSummed(sum_dtype=torch.float32), ReplicatedSharedExpert(),
              ReplicatedSharedExpert(sum_scale=0.22), ReplicatedSharedExpert(sum_scale=("view first", 0.22))]
    torch.manual_seed(100 + rank)  # different activations per rank: the all-reduce matters
    inputs = (torch.randn(1, 6, H, dtype=torch.bfloat16), torch.randn(1, 6, H, dtype=torch.bfloat16))
    cases = [(model, inputs) for model in models] + [_tensor_parallel_gated_expert(rank)]
    cases += [_tensor_parallel_dense_experts(rank, spelling) for spelling in DenseExperts.SPELLINGS]
    for model, args in cases:
        actual, expected, stats = compiled_vs_eager(model, args, dynamic=dynamic)
        assert stats["fused_sites"] == 1 and stats["unfused_sites"] == 0, (type(model).__name__, stats)
        looped = isinstance(model, DenseExperts) and model.spelling not in ("stack_sum", "einsum")
        gated = E - 1 if looped else int(getattr(model, "gated", False))
        assert stats["gated_all_reduces_merged"] == gated, stats
        for a, e in zip(actual, expected):
            assert_close(a, e, torch.bfloat16, type(model).__name__)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.multiproc
@pytest.mark.slow
def test_moe_ends_match_uncompiled(dynamic):
    run_workers(_moe_ends, 2, dynamic)


class RowThenColumn(nn.Module):
    """A row-parallel projection, its all-reduce, then a column-parallel one of the replicated
    result: each rank's weight shard differs, so the collective must stay before that GEMM.
    `after`: "bias" adds the column shard's bias after the GEMM (Megatron's `skip_bias_add`), a
    broadcasting add; "lora" adds a second column-sharded product of the same shape."""

    def __init__(self, rank, after, world=2, dtype=torch.bfloat16):
        super().__init__()
        self.after = after
        torch.manual_seed(0)
        w_row, w_col, w_lora = (torch.randn(H, H, dtype=dtype) / 16 for _ in range(3))
        bias = torch.randn(H, dtype=dtype)
        cols = slice(rank * H // world, (rank + 1) * H // world)
        self.w_row = nn.Parameter(w_row[:, cols].contiguous())  # input dims sharded
        self.w_col, self.w_lora = nn.Parameter(w_col[cols].contiguous()), nn.Parameter(w_lora[cols].contiguous())
        self.bias = nn.Parameter(bias[cols].contiguous())

    def forward(self, x_shard, other):
        y = x_shard @ self.w_row.t()
        dist.all_reduce(y)
        out = y @ self.w_col.t()
        return out + (self.bias if self.after == "bias" else other @ self.w_lora.t())


def _column_after_all_reduce(rank):
    for after in ("bias", "lora"):
        model = RowThenColumn(rank, after)
        torch.manual_seed(100 + rank)  # this rank's input shard
        x_shard = torch.randn(2, 3, H // 2, dtype=torch.bfloat16)
        torch.manual_seed(7)
        other = torch.randn(2, 3, H, dtype=torch.bfloat16)
        actual, expected, stats = compiled_vs_eager(model, (x_shard, other))
        assert stats["matmuls_moved_before_all_reduce"] == 0, (after, stats)
        assert_close(actual, expected, torch.bfloat16, after)


@pytest.mark.multiproc
def test_a_column_parallel_projection_stays_after_the_all_reduce():
    """[B, S, H] activations (the GEMM a view, mm, view, its add apart): the matmul move is for a
    dense MoE's einsum over stacked experts, never for a weight that differs per rank."""
    run_workers(_column_after_all_reduce, 2)


def test_stats_name_the_rewrites(fake_pg):
    arfusion.reset_stats()
    run(RoutedPlusShared())
    run(ExpertRowsSummed())
    stats = arfusion.stats()
    assert (stats["summed_all_reduces_merged"], stats["sums_moved_before_all_reduce"]) == (1, 1)
    assert stats["gated_all_reduces_merged"] == 0
