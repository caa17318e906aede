"""Which sites the pass rewrites, on graphs compiled against a fake process group."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import arfusion
from arfusion.decisions import Why
from arfusion.fusion_pass import ALL_REDUCE, ArFusionPass, ChainedPass
from arfusion.testing import not_fused_reasons

from .models import RowParallelThenNorm, TinyDecoder
from .sites import PATTERN_HIDDEN, AllSpellings, compile_and_inspect, inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_spelling_fuses_with_its_own_eps(fake_pg, dtype):
    model = AllSpellings(dtype)
    fused, left, stats = compile_and_inspect(model, *inputs(dtype))
    assert left == 0
    # 2 residual spellings x 2 Llama spellings; 2 x Gemma; no residual: 2 Llama, 1 Gemma.
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm": 4, "allreduce_add_gemma_rmsnorm": 2,
                                   "allreduce_rmsnorm": 2, "allreduce_gemma_rmsnorm": 1}
    # Each site keeps its own eps, norm form and residual form.
    expected = {(eps, "gemma_rms" if n == "gemma" else "rms", r != "none")
                for (r, n), eps in zip(model.combos, model.EPS)}
    got = {(args["eps"], args["norm"], args["residual"] is not None) for args in fused}
    assert got == expected


def test_dynamic_shapes_fuse_with_tensor_eps(fake_pg):
    fused, left, _ = compile_and_inspect(AllSpellings(torch.bfloat16), *inputs(torch.bfloat16), dynamic=True)
    assert len(fused) == 9 and left == 0
    assert all(args["eps_tensor"] is not None for args in fused)  # eps arrives as a 0-d tensor


def test_decoder_has_2L_plus_1_sites(fake_pg):
    layers = 3
    fused, left, stats = compile_and_inspect(TinyDecoder(PATTERN_HIDDEN, layers), torch.randn(1, 5, PATTERN_HIDDEN, dtype=torch.bfloat16))
    assert stats["fused_sites"] == 2 * layers + 1 and left == 0
    assert stats["by_pattern"] == {"allreduce_rmsnorm": 1, "allreduce_add_rmsnorm": 2 * layers}


@pytest.mark.parametrize("batch,seq", [(3, 8), (6, 4), (5, 7)])
def test_a_batch_that_does_not_divide_the_probe_rows_fuses(fake_pg, batch, seq):
    """[B, S, H] activations with B not dividing the probe's 32 rows (a prefill batch of 3): the
    probe folds the token dims instead of failing (`probe_failed`)."""
    fused, left, stats = compile_and_inspect(TinyDecoder(PATTERN_HIDDEN, 2),
                                             torch.randn(batch, seq, PATTERN_HIDDEN, dtype=torch.bfloat16))
    assert stats["fused_sites"] == 5 and left == 0, stats


class _SelectedTokens(nn.Module):
    """The tokens a mask selects, then a site: a token count known only at run time (unbacked)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, residual, keep):
        return self.block(x[keep], residual[keep])


@pytest.mark.parametrize("how", ["unbacked", "size_oblivious", "masked"])
def test_a_graph_for_any_token_count_fuses_and_serves_an_empty_batch(world_of_one, how):
    """A token count without an example value (`mark_unbacked`, or the tokens a mask selects) raised
    in the pass (the whole graph then stayed unfused, `pass_failed`, with a WARNING); one traced at
    0 under size-oblivious tracing was left unfused as an empty batch, and that graph served every
    later count. All now fuse, and an empty call runs unfused at run time (`zero_tokens`)."""
    # The config modules' own patch(), not monkeypatch: pytest 9.2 restores a name missing from a
    # module's __dict__ by deleting it, and a torch config module then hides that setting for good.
    patch = {
        "size_oblivious": torch.fx.experimental._config.patch(backed_size_oblivious=True),
        "masked": torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True),
    }.get(how, contextlib.nullcontext())
    with patch:
        _serve_any_token_count(how)


def _serve_any_token_count(how):
    torch.manual_seed(0)
    block = RowParallelThenNorm(64)
    model = _SelectedTokens(block) if how == "masked" else block
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
    compiled = torch.compile(model, options=options, dynamic=how != "masked")
    for tokens in (0, 8, 1):
        x, r = torch.randn(2, 8 if how == "masked" else tokens, 64, dtype=torch.bfloat16).unbind(0)
        args = (x, r, torch.arange(8) < tokens) if how == "masked" else (x, r)
        if how == "unbacked":
            torch._dynamo.decorators.mark_unbacked(x, 0)
            torch._dynamo.decorators.mark_unbacked(r, 0)
        with torch.no_grad():
            got, want = compiled(*args), model(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape == (tokens, 64)
            assert not tokens or torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    stats = arfusion.stats()
    assert stats["graphs"] == 1 and stats["fused_sites"] == 1 and stats["why_not_codes"] == {}, stats
    assert stats["dispatch"] == {"fallback": 1, "torch": 2}


def test_residual_sum_not_used_later_still_fuses(fake_pg):
    model = RowParallelThenNorm(PATTERN_HIDDEN, sum_unused=True)
    fused, left, _ = compile_and_inspect(model, *inputs(torch.bfloat16))
    assert len(fused) == 1 and left == 0


def test_tp_subgroup_fuses_with_its_own_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        tp_group = dist.new_group([0, 1])
        model = RowParallelThenNorm(PATTERN_HIDDEN, group=tp_group)
        fused, left, _ = compile_and_inspect(model, *inputs(torch.bfloat16))
        assert left == 0
        assert [args["group_name"] for args in fused] == [tp_group.group_name]
        assert tp_group.group_name != dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ must not fuse


class MaxReduce(RowParallelThenNorm):
    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        return self.norm(residual + y), residual + y


class NormOverOtherDim(RowParallelThenNorm):
    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = (residual + y).float()
        out = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)
        return self.norm.weight * out.to(x.dtype), residual + y


class LayerNormAfter(RowParallelThenNorm):
    def __init__(self, hidden):
        super().__init__(hidden)
        self.ln = nn.LayerNorm(hidden, dtype=torch.bfloat16)

    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = residual + y
        return self.ln(h), h


class RsqrtUsedElsewhere(RowParallelThenNorm):
    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = (residual + y)
        hf = h.float()
        inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm.weight * (hf * inv).to(h.dtype), h, inv


class NormalizedFp32UsedElsewhere(RowParallelThenNorm):
    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = residual + y
        hf = h.float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm.weight * normed.to(h.dtype), h, normed.sum()


@pytest.mark.parametrize("model_cls", [MaxReduce, NormOverOtherDim, LayerNormAfter, RsqrtUsedElsewhere,
                                       NormalizedFp32UsedElsewhere])
def test_lookalikes_stay_unfused(fake_pg, model_cls):
    fused, left, stats = compile_and_inspect(model_cls(PATTERN_HIDDEN), *inputs(torch.bfloat16))
    assert fused == [] and left == 1 and stats["fused_sites"] == 0


# ------------------------------------------------------------------ switches


def test_size_cap_declines_at_compile_time_and_says_why(fake_pg, caplog):
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", max_size_mb={2: 0.001})
    with caplog.at_level(logging.INFO, logger="arfusion"):
        fused, left, _ = compile_and_inspect(RowParallelThenNorm(PATTERN_HIDDEN), *inputs(torch.bfloat16), config=config)
    assert fused == [] and left == 1
    assert "not fused" in caplog.text and "cap 1048" in caplog.text


def test_one_reason_is_said_once_for_all_the_all_reduces_it_holds_for(fake_pg, caplog):
    """Five sites over the cap: one INFO line naming the five, not five lines."""
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", max_size_mb={2: 0},
                                 fast_all_reduce=False)
    with caplog.at_level(logging.INFO, logger="arfusion"):
        fused, left, stats = compile_and_inspect(TinyDecoder(PATTERN_HIDDEN, 2),
                                                 torch.randn(1, 6, PATTERN_HIDDEN, dtype=torch.bfloat16), config=config)
    assert fused == [] and left == 5 and stats["why_not_codes"] == {Why.SIZE_CAP.value: 5}, stats
    said = [r.getMessage() for r in caplog.records if " not fused: " in r.getMessage()]
    assert len(said) == 1 and "(5 all-reduces) not fused: " in said[0] and "> cap 0" in said[0], said
    (reason,) = not_fused_reasons(said)  # which counts each all-reduce the line names
    assert not_fused_reasons(said) == {reason: 5}


def _all_reduces_by_kind(module, *inputs, config):
    """Compile with the pass; count the all-reduces it leaves: (functional, on the caller's stream)."""
    seen = {}

    def inspect(graph):
        ours = torch.ops.arfusion.all_reduce_.default
        seen["functional"] = sum(1 for n in graph.nodes if n.target is ALL_REDUCE)
        seen["current_stream"] = sum(1 for n in graph.nodes if n.target is torch.ops.higher_order.auto_functionalized
                                     and n.args[0] is ours)

    options = {"post_grad_custom_post_pass": ChainedPass([ArFusionPass(config), inspect])}
    with torch.no_grad():
        torch.compile(module, options=options)(*inputs)
    return seen["functional"], seen["current_stream"]


def test_declined_site_all_reduces_on_the_callers_stream(fake_pg, monkeypatch, caplog):
    capped = dict(enable_allreduce_fusion=True, backend="torch", max_size_mb={2: 0}, fast_all_reduce=False)
    model, args = TinyDecoder(PATTERN_HIDDEN, layers=2), (torch.randn(1, 6, PATTERN_HIDDEN, dtype=torch.bfloat16),)
    # On CPU the functional all-reduce stays (the gain is a CUDA-graph one).
    assert _all_reduces_by_kind(model, *args, config=arfusion.PassConfig(**capped)) == (5, 0)
    monkeypatch.setattr(arfusion.policy, "current_stream_pays", lambda device: True)  # as on CUDA
    torch._dynamo.reset()
    before = arfusion.stats()
    with caplog.at_level(logging.INFO, logger="arfusion"):
        assert _all_reduces_by_kind(model, *args, config=arfusion.PassConfig(**capped)) == (0, 5)
    assert "5 all_reduce left unfused" in caplog.text and "5 of them run on the caller's stream" in caplog.text
    after = arfusion.stats()
    assert after["unfused_sites"] - before["unfused_sites"] == 5
    assert after["unfused_on_callers_stream"] - before["unfused_on_callers_stream"] == 5
    torch._dynamo.reset()
    off = arfusion.PassConfig(**capped, unfused_on_current_stream=False)
    before = arfusion.stats()
    assert _all_reduces_by_kind(model, *args, config=off) == (5, 0)
    after = arfusion.stats()
    assert (after["unfused_sites"] - before["unfused_sites"],
            after["unfused_on_callers_stream"] - before["unfused_on_callers_stream"]) == (5, 0)
    torch._dynamo.reset()  # fused sites are not touched
    fused = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
    assert _all_reduces_by_kind(model, *args, config=fused) == (0, 0)


def test_cap_for_another_world_size_does_not_apply(fake_pg):
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", max_size_mb={4: 0})
    fused, _, _ = compile_and_inspect(RowParallelThenNorm(PATTERN_HIDDEN), *inputs(torch.bfloat16), config=config)
    assert len(fused) == 1


def test_env_opt_out(fake_pg, monkeypatch):
    monkeypatch.setenv("ARFUSION_DISABLE", "1")
    fused, left, _ = compile_and_inspect(RowParallelThenNorm(PATTERN_HIDDEN), *inputs(torch.bfloat16))
    assert fused == [] and left == 1


def test_flag_off_does_nothing(fake_pg):
    config = arfusion.PassConfig(enable_allreduce_fusion=False)
    fused, left, _ = compile_and_inspect(RowParallelThenNorm(PATTERN_HIDDEN), *inputs(torch.bfloat16), config=config)
    assert fused == [] and left == 1


def test_auto_on_cpu_uses_the_torch_backend(fake_pg):
    config = arfusion.PassConfig(enable_allreduce_fusion=True)
    fused, _, stats = compile_and_inspect(RowParallelThenNorm(PATTERN_HIDDEN), *inputs(torch.bfloat16), config=config)
    assert [args["backend"] for args in fused] == ["auto"]
    assert stats["dispatch"] == {"torch": 1}


def test_one_info_line_per_graph(fake_pg, caplog):
    with caplog.at_level(logging.INFO, logger="arfusion"):
        compile_and_inspect(TinyDecoder(PATTERN_HIDDEN, 1), torch.randn(1, 3, PATTERN_HIDDEN, dtype=torch.bfloat16))
    lines = [r.getMessage() for r in caplog.records if "fused 3 site(s)" in r.getMessage()]
    assert len(lines) == 1 and "0 all_reduce left unfused" in lines[0]


def test_identical_sites_are_classified_once(fake_pg, monkeypatch):
    """A decoder's sites compute the same thing: each distinct region is evaluated once, not
    once per site (65 probes per graph would cost seconds on a 32-layer model)."""
    from arfusion.patterns import classify

    classify.clear_memo()
    calls = []
    real = classify.Classifier.classify
    monkeypatch.setattr(classify.Classifier, "classify", lambda self: calls.append(1) or real(self))
    layers = 6
    fused, left, stats = compile_and_inspect(TinyDecoder(PATTERN_HIDDEN, layers), torch.randn(8, PATTERN_HIDDEN, dtype=torch.bfloat16))
    assert len(fused) == 2 * layers + 1 and left == 0
    # The embedding site, the residual sites, and the last one (nothing reads its sum later).
    assert len(calls) == 3
    assert stats["pass_seconds"] > 0


class SiteOnAnInput(nn.Module):
    """A site whose all-reduce reads a graph input, and one whose all-reduce input is also returned."""

    def __init__(self, hidden=PATTERN_HIDDEN):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-6, dtype=torch.bfloat16) for _ in range(2))

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        first = self.norms[0](funcol.all_reduce(x, "sum", dist.group.WORLD))
        y = self.proj(first)
        return self.norms[1](first + funcol.all_reduce(y, "sum", dist.group.WORLD)), y


def test_a_sole_read_input_is_all_reduced_in_place_and_any_other_is_left_alone(fake_pg, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    from arfusion import execution

    # The compiled unfused path, as on a GPU: it reduces x itself where the op may overwrite it.
    monkeypatch.setattr(execution, "compiles_fallback", lambda device: True)
    scratch = []
    real = execution.all_reduce_on_current_stream
    monkeypatch.setattr(execution, "all_reduce_on_current_stream",
                        lambda x, g, on_x=False: scratch.append(on_x) or real(x, g, on_x))
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", max_size_mb={2: 0.0001})
    options = {"post_grad_custom_post_pass": ArFusionPass(config)}
    torch.manual_seed(0)
    model, x = TinyDecoder(PATTERN_HIDDEN, layers=2), torch.randn(1, 6, PATTERN_HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        got, (code, *_) = run_and_get_code(torch.compile(model, options=options, dynamic=True), x)
    # Every site's x is a matmul's output: the op gets that buffer itself (no copy), which Inductor
    # reuses after it, except the first site's: without a residual its first output is the sum. The
    # values are the eager model's.
    assert code.count("torch.ops.arfusion.fused_allreduce_rmsnorm_.default(") == 4 and "clone" not in code
    assert code.count("torch.ops.arfusion.fused_allreduce_rmsnorm.default(") == 1
    assert scratch == [False] + [True] * 4
    torch.testing.assert_close(got, want, atol=4e-2, rtol=2e-2)  # 5 norms compiled vs eager: 2 bf16 ulps at 2-4
    torch._dynamo.reset()
    scratch.clear()
    model, x = SiteOnAnInput(), torch.randn(4, PATTERN_HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        got, (code, *_) = run_and_get_code(torch.compile(model, options=options, dynamic=True), x)
    assert code.count("torch.ops.arfusion.fused_allreduce_rmsnorm.default(") == 2 and "rmsnorm_.default" not in code
    assert scratch == [False, False]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=4e-2, rtol=2e-2)


def test_sole_reader_follows_views_to_new_memory_and_nothing_else():
    from arfusion.graph_utils import sole_reader

    aten = torch.ops.aten
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    mm = g.call_function(aten.mm.default, (a, b))
    hidden = g.call_function(aten._unsafe_view.default, (mm, [1, 4, 8]))  # a view its schema does not mark
    reader = g.call_function(aten.relu.default, (hidden,))
    view_of_input = g.call_function(aten.view.default, (a, [4, 8]))
    reader_of_input = g.call_function(aten.relu.default, (view_of_input,))
    shared = g.call_function(aten.mm.default, (a, b))  # its output read twice: through a view, and directly
    view = g.call_function(aten.view.default, (shared, [32]))
    reader_of_view = g.call_function(aten.relu.default, (view,))
    other = g.call_function(aten.neg.default, (shared,))
    unmarked = g.call_function(aten._unsafe_view.default, (shared, [32]))
    reader_of_unmarked = g.call_function(aten.relu.default, (unmarked,))
    g.output((reader, reader_of_input, reader_of_view, other, reader_of_unmarked))
    assert sole_reader(hidden, reader) and sole_reader(mm, hidden)
    assert not sole_reader(view_of_input, reader_of_input)  # a view of a graph input
    assert not sole_reader(view, reader_of_view)  # the view is read once, its base more often
    assert not sole_reader(unmarked, reader_of_unmarked)  # the same through _unsafe_view
    assert not sole_reader(hidden, reader_of_input)  # not its reader
