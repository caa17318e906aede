"""An error inside the pass costs the fusion, never the user's compile: the graph is put back as
it was (unfused, what Inductor alone compiles), the reason lands in stats() and a WARNING; with
ARFUSION_STRICT=1 (set for this test suite in conftest.py) the error fails the compile instead."""

from __future__ import annotations

import logging

import pytest
import torch

import arfusion
from arfusion import edits
from arfusion.config import STRICT_ENV
from arfusion.graph_utils import restore, snapshot

from .models import TinyDecoder


def _fail_on_second_rewrite(monkeypatch):
    """The first site is rewritten for real (the graph is changed), the second raises."""
    real, calls = edits.fuse, []

    def fuse(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug in a rewrite")
        return real(*args, **kwargs)

    monkeypatch.setattr(edits, "fuse", fuse)
    return calls


def _compiled(model, **config):
    return torch.compile(model, options=arfusion.inductor_options(
        arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", **config)))


def test_an_error_in_the_pass_leaves_the_graph_unfused_and_correct(world_of_one, monkeypatch, caplog):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    torch.manual_seed(0)
    model, x = TinyDecoder(hidden=64, layers=2), torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = torch.compile(model)(x)  # Inductor alone: what the restored graph must compute
        torch._dynamo.reset()
        calls = _fail_on_second_rewrite(monkeypatch)
        with caplog.at_level(logging.WARNING, logger="arfusion"):
            got = _compiled(model)(x)
    assert len(calls) == 2  # the first site had been rewritten when the second failed
    assert torch.equal(got, plain)
    s = arfusion.stats()
    assert s["fused_sites"] == 0 and s["dispatch"] == {}  # no fused op left in the graph, none ran
    assert s["unfused_sites"] == 5
    assert s["why_not_codes"] == {"pass_failed": 5}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "a bug in a rewrite" in warnings[0]  # the error, for the bug report


def test_strict_mode_fails_the_compile(world_of_one, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    model, x = TinyDecoder(hidden=64, layers=2), torch.randn(5, 64, dtype=torch.bfloat16)
    _fail_on_second_rewrite(monkeypatch)
    with torch.no_grad(), pytest.raises(Exception, match="a bug in a rewrite"):
        _compiled(model)(x)


def test_the_next_graph_fuses_again(world_of_one, monkeypatch):
    """A failure is per graph: the pass stays installed and fuses the next compile."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    model, x = TinyDecoder(hidden=64, layers=2), torch.randn(5, 64, dtype=torch.bfloat16)
    calls = _fail_on_second_rewrite(monkeypatch)
    with torch.no_grad():
        _compiled(model)(x)
        calls.append(1)  # past the failing call: every later rewrite is real
        torch._dynamo.reset()
        arfusion.reset_stats()
        want = model(x)
        got = _compiled(model)(x)
    assert arfusion.stats()["fused_sites"] == 5 and arfusion.stats()["why_not_codes"] == {}
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_restore_puts_back_every_node():
    def f(x, y):
        return torch.relu(x + y) * 2

    gm = torch.fx.symbolic_trace(f)
    graph = gm.graph
    before = [(n.op, n.target, str(n.args)) for n in graph.nodes]
    saved = snapshot(graph)
    add = next(n for n in graph.nodes if n.target is torch.relu).args[0]
    with graph.inserting_after(add):  # a half-done rewrite: a new node, users moved, one erased
        neg = graph.call_function(torch.neg, (add,))
    relu = next(n for n in graph.nodes if n.target is torch.relu)
    relu.replace_all_uses_with(neg)
    graph.erase_node(relu)
    restore(graph, saved)
    after = [(n.op, n.target) for n in graph.nodes]
    assert after == [(op, target) for op, target, _ in before]
    gm.recompile()
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(gm(x, y), f(x, y))


def _gradient_all_reduce_hook(module, grad_input, grad_output):  # stands in for transformers <= 5.17's
    pass


# Named as transformers 5.17 names it (ReplicatedWithGradAllReduce.install_forward's local function).
_gradient_all_reduce_hook.__module__ = "transformers.distributed.tensor_parallel"
_gradient_all_reduce_hook.__qualname__ = "ReplicatedWithGradAllReduce.install_forward.<locals>._all_reduce_grads"


def _users_hook(module, grad_input, grad_output):
    pass


def test_transformers_grad_allreduce_hooks_break_graphs_until_dropped(world_of_one):
    """transformers <= 5.17 puts a full backward hook on per-head q/k norms; Dynamo breaks the
    graph at each, so all-reduce and norm land in different graphs. drop_grad_allreduce_hooks
    removes exactly those hooks (not a user's), and every site fuses again."""
    from arfusion.hf import drop_grad_allreduce_hooks

    model, x = TinyDecoder(hidden=64, layers=2), torch.randn(5, 64, dtype=torch.bfloat16)
    for norm in model.norms[1:3]:
        norm.register_full_backward_hook(_gradient_all_reduce_hook)
    model.norms[4].register_full_backward_hook(_users_hook)
    with torch.no_grad():
        want = model(x)
        _compiled(model)(x)
        before = arfusion.stats()  # Dynamo gave up on the layer loop: no graph met the pass, nothing fused
        assert (before["graphs"], before["fused_sites"]) == (0, 0), before

        assert drop_grad_allreduce_hooks(model) == 2
        assert [len(n._backward_hooks) for n in model.norms] == [0, 0, 0, 0, 1]  # the user's hook stays
        model.norms[4]._backward_hooks.clear()  # (it breaks graphs too; not ours to remove)
        torch._dynamo.reset()
        arfusion.reset_stats()
        got = _compiled(model)(x)
    assert arfusion.stats()["fused_sites"] == 5
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
