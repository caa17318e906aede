"""Grad mode and training with the pass on: the gradients Inductor alone gives, always.

docs/usage.md: compile under no_grad for fusion; in grad mode a site whose values are saved for
backward stays unfused (`read_elsewhere`). Here a user who called `arfusion.enable()` also trains:
full training, frozen weights, a frozen prefix (whose forward graph fuses), activation
checkpointing, autocast, dynamic shapes, torch's own TP (DTensor: all-reduces in the backward
graph) and dropout in training mode. Outputs and every gradient are compared with eager and with
Inductor without the pass; what was fused and why not, by code, in each graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import arfusion
from arfusion.decisions import Fate, Why
from arfusion.testing import fusion_report

from .models import LlamaStyleRMSNorm

HIDDEN, TOKENS = 64, 8


class Site(nn.Module):
    """o_proj -> all-reduce -> [dropout] -> + residual -> RMSNorm. The functional all-reduce has an
    autograd formula (its backward all-reduces the gradient), as the graph Dynamo traces has, so
    eager and compiled compute the same gradients (eager `dist.all_reduce` has none: torch warns)."""

    def __init__(self, dtype=torch.bfloat16, dropout=0.0):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.norm = LlamaStyleRMSNorm(HIDDEN, dtype=dtype)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, residual):
        h = residual + self.drop(funcol.all_reduce(self.proj(x), "sum", dist.group.WORLD))
        return self.norm(h), h


# ------------------------------------------------------------------ dropout in training mode
def _dropout_report(p, fallback_random, grad):
    torch.manual_seed(0)
    model = Site(dropout=p).train()
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=grad)
    with torch._inductor.config.patch(fallback_random=fallback_random):
        return fusion_report(model, (x, torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)), grad=grad)


@pytest.mark.parametrize("fallback_random", [False, True], ids=["inductor_rng", "fallback_random"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_dropout_in_training_mode_stays_unfused_and_says_so(fallback_random, grad):
    """Dropout between the all-reduce and the norm (model.train()) is random: the site must stay
    unfused, and the reason must name it. Inductor's RNG makes the mask outside the region (a bool
    factor, once taken for a residual of another dtype); torch's (fallback_random) a
    native_dropout the region stops at (once "no RMSNorm reads the all-reduced value")."""
    report = _dropout_report(0.5, fallback_random, grad)
    (row,) = report.rows
    assert row.fate is not Fate.FUSED and row.code == Why.RANDOM.value, report
    assert any("random" in line and "dropout" in line for line in report.log), report.log


def test_dropout_of_zero_in_training_mode_fuses():
    """p=0 (transformers' default attention/hidden dropout) draws nothing: the site fuses under no_grad."""
    (row,) = _dropout_report(0.0, False, False).rows
    assert row.fate is Fate.FUSED


def test_autocast_keeps_an_fp32_residual_stream_unfused_and_says_so():
    """Under autocast the projection gives bf16, the residual stream stays fp32: `residual_dtype`."""
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (row,) = fusion_report(Site(dtype=torch.float32), (x, torch.randn(TOKENS, HIDDEN)), grad=True).rows
    assert row.fate is not Fate.FUSED and row.code == Why.RESIDUAL_DTYPE.value


class DropPathBranches(nn.Module):
    """Two all-reduced branches summed into the residual stream, one under a random per-token factor
    (stochastic depth, `x * keep`), as parallel attention + MLP blocks train with drop path."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)
        self.b = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)
        self.norm = LlamaStyleRMSNorm(HIDDEN)

    def forward(self, x, residual):
        keep = (torch.rand(x.shape[0], 1, dtype=x.dtype) + 0.5).floor() + 1  # 1 or 2 per token
        h = residual + funcol.all_reduce(self.a(x), "sum", dist.group.WORLD) \
            + funcol.all_reduce(self.b(x), "sum", dist.group.WORLD) * keep
        return self.norm(h), h


@pytest.mark.parametrize("fallback_random", [False, True], ids=["inductor_rng", "fallback_random"])
def test_a_random_factor_is_not_moved_across_an_all_reduce(fallback_random):
    """AR(a) + keep * AR(b) -> AR(a + keep * b) holds only where keep is the same on every rank; a
    random draw is the one factor that need not be (ranks seeded apart). The merge is declined
    (INFO, `per_rank`); the other all-reduce still fuses, this one says `random`."""
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    with torch._inductor.config.patch(fallback_random=fallback_random):
        report = fusion_report(DropPathBranches().train(), (x, torch.randn_like(x)))
    assert [(r.fate, r.code) for r in report.rows] == [(Fate.FUSED, None), (Fate.FAST_PATH, Why.RANDOM.value)], report
    assert any(Why.PER_RANK.value in line and "random" in line for line in report.log), report.log


# ------------------------------------------------------------------ training steps on 2 gloo ranks
class Head(nn.Module):
    """A frozen site, then a layer that trains (a frozen prefix, LoRA-style fine-tuning of the top)."""

    def __init__(self):
        super().__init__()
        self.site = Site().requires_grad_(False)
        self.head = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)

    def forward(self, x, residual):
        normed, h = self.site(x, residual)
        return self.head(normed), h


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = (nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16) for _ in range(2))
        self.norms = nn.ModuleList(LlamaStyleRMSNorm(HIDDEN) for _ in range(2))

    def forward(self, normed, residual):
        for proj, norm in zip((self.attn, self.mlp), self.norms):
            residual = residual + funcol.all_reduce(proj(normed), "sum", dist.group.WORLD)
            normed = norm(residual)
        return normed, residual


class Checkpointed(nn.Module):
    """Two decoder layers under activation checkpointing (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, normed, residual):
        for layer in self.layers:
            normed, residual = torch.utils.checkpoint.checkpoint(layer, normed, residual, use_reentrant=False)
        return normed


def _torch_tp_decoder():
    """examples/compile_torch_tp.py's decoder (1 layer) under torch's own TP plan (DTensor)."""
    import argparse
    import importlib.util
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    path = Path(__file__).resolve().parents[1] / "examples" / "compile_torch_tp.py"
    spec = importlib.util.spec_from_file_location("compile_torch_tp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(layers=1, hidden=HIDDEN, vocab=128, dtype="bf16", norm="rmsnorm",
                              sequence_parallel=False)
    return example.build(args, init_device_mesh("cpu", (dist.get_world_size(),)), torch.device("cpu"))


def _case(name):
    """(model, inputs(tokens), the fates and codes by graph: forward, backward)."""
    torch.manual_seed(0)
    model = {"full": Site, "frozen_weights": Site, "norm_weight_only": Site, "dynamic": Site,
             "frozen_prefix": Head, "checkpoint": Checkpointed, "torch_tp": _torch_tp_decoder}[name]()
    if name == "frozen_weights":
        model.proj.requires_grad_(False)
        model.norm.requires_grad_(False)
    if name == "norm_weight_only":
        model.proj.requires_grad_(False)
    input_grad = name in ("full", "frozen_weights", "dynamic", "checkpoint")

    def inputs(tokens):
        torch.manual_seed(1 + (name != "torch_tp") * dist.get_rank())  # token ids alike on every rank
        if name == "torch_tp":
            return (torch.randint(0, 128, (1, tokens)),)
        return tuple(torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=input_grad) for _ in range(2))

    unfused, grad_ar = [(Fate.FAST_PATH, Why.READ_ELSEWHERE)], [(Fate.FAST_PATH, Why.NO_NORM)]
    expected = {"full": [unfused, grad_ar], "frozen_weights": [unfused, grad_ar], "dynamic": [unfused, grad_ar],
                "norm_weight_only": [unfused],  # no gradient flows back to the all-reduce
                "frozen_prefix": [[(Fate.FUSED, None)]],  # nothing before the norm needs a gradient
                "checkpoint": [[(Fate.FUSED, None)] * 4, None],  # recomputed in backward: unfused there
                "torch_tp": [[(Fate.FAST_PATH, Why.READ_ELSEWHERE)] * 3, None]}[name]
    return model, inputs, expected


def _step(fn, model, inputs):
    model.zero_grad(set_to_none=True)
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((k + 1) * o.float()).sum() for k, o in enumerate(outs)).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad] + [i.grad for i in inputs if i.requires_grad]
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    return [o.detach() for o in outs] + full


def _by_graph(decisions):
    graphs = {}
    for d in decisions:
        graphs.setdefault(d["graph"], []).append((d["decision"].fate, d["decision"].not_fused
                                                  and d["decision"].not_fused.code))
    return list(graphs.values())


def _train_step(rank, name):
    """One training step per batch size, eager, compiled by Inductor alone and with the pass."""
    import warnings

    from .helpers import assert_close

    model, inputs, expected = _case(name)
    sizes = (TOKENS, 5) if name == "dynamic" else (TOKENS,)
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
    alone = torch.compile(model, dynamic=name == "dynamic")
    fused = torch.compile(model, dynamic=name == "dynamic", options=options)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(autograd kernel|derivative).*")
        for tokens in sizes:
            eager = _step(model, model, inputs(tokens))
            want = _step(alone, model, inputs(tokens))
            arfusion.reset_stats()
            got = _step(fused, model, inputs(tokens))
            graphs = _by_graph(arfusion.stats.decisions())
            for k, (g, a, e) in enumerate(zip(got, want, eager)):
                assert_close(g, e, torch.bfloat16, f"{name} at {tokens} tokens: output or gradient {k} against eager")
                if graphs and all(f is not Fate.FUSED for graph in graphs for f, _ in graph) and name != "torch_tp":
                    assert torch.equal(g, a), f"{name}: unfused, yet output or gradient {k} differs from Inductor's"
            if tokens == TOKENS:  # the dynamic graph serves the second size without a recompile
                assert len(graphs) == len(expected), graphs
                for graph, want_graph in zip(graphs, expected):
                    assert want_graph is None or graph[:len(want_graph)] == want_graph, graphs
                assert all(f is not Fate.FUSED for f, _ in graphs[-1]) or len(graphs) == 1, graphs
            else:
                assert graphs == [], graphs


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("name", ["full", "frozen_weights", "norm_weight_only", "frozen_prefix", "dynamic",
                                  "checkpoint", "torch_tp"])
def test_a_training_step_gets_inductors_gradients(name):
    """Per case, on 2 gloo ranks: outputs and every gradient within bf16 of eager; bit-equal to
    Inductor's without the pass wherever nothing fused; what each graph fused and why not."""
    from .helpers import run_workers

    run_workers(_train_step, 2, name)
