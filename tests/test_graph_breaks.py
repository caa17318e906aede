"""Graph breaks that split an all-reduce from its norm are named (arfusion/graph_breaks.py): the
all-reduce's row has the code Why.GRAPH_BREAK and its decision the function; the function is in
the report `arfusion check` prints, in stats()["split_by_graph_breaks"] and once in the INFO log.
An all-reduce that is the model's output is Why.GRAPH_OUTPUT, no break named. One process, a fake
world of 2."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from arfusion.decisions import Fate, Why
from arfusion.stats import decisions
from arfusion.testing import fusion_report


@torch.compiler.disable
def opaque_update(x):
    """Stands for a library function compiled out, like transformers' paged-cache update."""
    return x * 1.0


class RMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    """The break sits inside the call, before the all-reduce: Dynamo compiles this frame alone and
    the all-reduce leaves its graph when the frame returns (the continuous-batching shape)."""

    def __init__(self, hidden):
        super().__init__()
        self.qkv, self.o_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        h = opaque_update(self.qkv(x))
        out = self.o_proj(h)
        dist.all_reduce(out)
        return out


class Layer(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.attn, self.norm = Attention(hidden), RMSNorm(hidden)

    def forward(self, x):
        return self.norm(x + self.attn(x))


class BreakAfterAllReduce(nn.Module):
    """The break itself ends the graph that holds the all-reduce."""

    def __init__(self, hidden=64):
        super().__init__()
        self.proj, self.norm = nn.Linear(hidden, hidden, bias=False), RMSNorm(hidden)

    def forward(self, x):
        y = self.proj(x)
        dist.all_reduce(y)
        return self.norm(x + opaque_update(y))


def test_a_break_inside_the_call_is_named(caplog):
    with caplog.at_level(logging.INFO, "arfusion"):
        report = fusion_report(Layer(), torch.randn(1, 4, 64))
    assert report.fused == 0 and report.all_reduces == 1, report
    assert report.stats["split_by_graph_breaks"] == {"opaque_update": 1}
    assert report.rows[0].code == Why.GRAPH_BREAK.value and report.stats["why_not_codes"] == {"graph_break": 1}
    (decision,) = decisions()
    assert decision["graph_break"] == "opaque_update" and "opaque_update" in decision["reason"]  # names it
    assert "graph breaks that split sites: opaque_update splits 1 all-reduce from its norm" in str(report)
    named = [r.getMessage() for r in caplog.records if "test_graph_breaks.py:" in r.getMessage()]
    assert len(named) == 1 and "opaque_update" in named[0], named  # once, with the function and its place


def test_a_break_that_ends_the_graph_is_named():
    report = fusion_report(BreakAfterAllReduce(), torch.randn(1, 4, 64))
    assert report.fused == 0 and report.stats["split_by_graph_breaks"] == {"opaque_update": 1}, report
    assert [row.code for row in report.rows] == [Why.GRAPH_BREAK.value], report


def test_without_a_break_nothing_is_named():
    class Returns(nn.Module):  # the all-reduce is the model's output: no graph break to name
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64, bias=False)

        def forward(self, x):
            y = self.proj(x)
            dist.all_reduce(y)
            return y

    report = fusion_report(Returns(), torch.randn(1, 4, 64))
    assert report.stats["split_by_graph_breaks"] == {}
    (row,) = report.rows
    assert (row.fate, row.code) == (Fate.FAST_PATH, Why.GRAPH_OUTPUT.value), report
    assert [d["graph_break"] for d in decisions()] == [""]
