"""The fast path for all-reduces that are not sites (`arfusion::all_reduce`): which all-reduces take
it, the caps, dynamic sizes, the NCCL fallback, and LayerNorm and hyper-connection models against
eager on two gloo ranks. The torch backend stands in for a GPU backend (it takes every size);
FlashInfer's and aiter's own decisions are tested in their backend tests."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist

import arfusion
from arfusion import execution
from arfusion.decisions import Fate, Reason, Why
from arfusion.edits import fused_calls
from arfusion.fusion_pass import ArFusionPass, ChainedPass
from arfusion.stats import decisions

from .models import HyperConnections, LayerNormBlock, RowParallelThenNorm, unfused_all_reduces
from .helpers import collect_from_ranks

HIDDEN = 64
FAST = torch.ops.arfusion.all_reduce.default
FUNCTIONAL = torch.ops._c10d_functional.all_reduce.default


def inputs(dtype=torch.bfloat16, tokens=8, streams=None):
    x = torch.randn(2, tokens, HIDDEN, dtype=dtype)
    other = torch.randn(2, tokens, *((streams,) if streams else ()), HIDDEN, dtype=dtype)
    return x, other


def compile_and_count(module, *args, dynamic=False, **config):
    """(fast-path ops, functional all-reduces, fused ops) in the compiled graph, and the stats."""
    seen = {}

    def inspect(graph):
        seen.update(fast=sum(n.target is FAST for n in graph.nodes),
                    functional=sum(n.target is FUNCTIONAL for n in graph.nodes),
                    fused=len(fused_calls(graph)),
                    left=unfused_all_reduces(graph))

    cfg = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", **config)
    with torch.no_grad():
        torch.compile(module, options={"post_grad_custom_post_pass": ChainedPass([ArFusionPass(cfg), inspect])},
                      dynamic=dynamic)(*args)
    return seen, arfusion.stats()


# The hyper-connection mix reaches the norm with per-token weights of another shape: OTHER_INPUTS.
@pytest.mark.parametrize("model, streams, code", [(LayerNormBlock, None, Why.LAYERNORM),
                                                  (HyperConnections, 4, Why.OTHER_INPUTS)])
def test_all_reduces_that_are_not_sites_go_on_the_fast_path(fake_pg, model, streams, code):
    seen, stats = compile_and_count(model(HIDDEN), *inputs(streams=streams))
    assert seen == {"fast": 1, "functional": 0, "fused": 0, "left": 1}
    assert stats["fast_path_all_reduces"] == 1 and stats["fused_sites"] == 0 and stats["unfused_sites"] == 1
    assert stats["why_not_codes"] == {code.value: 1}
    (decision,) = decisions()
    assert Fate(decision["fate"]) is Fate.FAST_PATH and decision["backend"] == "torch"
    assert decision["code"] == code.value and decision["fast_path_code"] is None


def test_a_site_still_fuses_and_takes_no_fast_path(fake_pg):
    seen, stats = compile_and_count(RowParallelThenNorm(HIDDEN), *inputs())
    assert seen == {"fast": 0, "functional": 0, "fused": 1, "left": 0} and stats["fast_path_all_reduces"] == 0


def test_opting_out_and_the_cap_leave_nccl(fake_pg, caplog):
    seen, _ = compile_and_count(LayerNormBlock(HIDDEN), *inputs(), fast_all_reduce=False)
    assert seen["fast"] == 0 and seen["functional"] == 1
    (decision,) = decisions()
    assert Fate(decision["fate"]) is Fate.NCCL and decision["fast_path_code"] == Why.FAST_PATH_OFF.value
    torch._dynamo.reset()
    arfusion.reset_stats()
    nbytes = 2 * 8 * HIDDEN * 2
    with caplog.at_level(logging.INFO, logger="arfusion"):
        seen, stats = compile_and_count(LayerNormBlock(HIDDEN), *inputs(), plain_max_size_mb={2: (nbytes - 1) / 2**20})
    assert seen["fast"] == 0 and seen["functional"] == 1 and stats["fast_path_all_reduces"] == 0
    (decision,) = decisions()
    assert Fate(decision["fate"]) is Fate.NCCL and decision["code"] == Why.LAYERNORM.value
    assert decision["fast_path_code"] == Why.SIZE_CAP.value
    assert str(nbytes) in decision["fast_path_reason"] and "plain_max_size_mb" in decision["fast_path_reason"]
    not_fast = decision["decision"].not_fast  # logged, for people, once
    assert [r.levelno for r in caplog.records if str(not_fast) in r.getMessage()] == [logging.INFO]
    torch._dynamo.reset()
    seen, _ = compile_and_count(LayerNormBlock(HIDDEN), *inputs(), plain_max_size_mb={2: nbytes / 2**20})
    assert seen["fast"] == 1  # the cap is inclusive


def test_dynamic_sizes_are_decided_per_call(fake_pg):
    seen, _ = compile_and_count(LayerNormBlock(HIDDEN), *inputs(), dynamic=True, plain_max_size_mb={2: 1})
    assert seen["fast"] == 1  # symbolic tokens: the op decides at run time


class _Declines:
    """A backend whose fast path declines every call at run time."""

    name = "declining"

    def plain_why_not(self, call, max_bytes_override=None):
        return Reason(Why.RUNTIME, "declined for the test")


def test_a_call_the_backend_declines_at_run_time_still_sums(world_of_one, monkeypatch):
    x = torch.randn(3, 5, 16)
    monkeypatch.setattr(execution, "resolve", lambda backend, device: (_Declines(), ""))
    got = torch.ops.arfusion.all_reduce(x=x, group_name=world_of_one, backend="torch")
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()  # a world of one: the sum is x
    assert arfusion.stats()["dispatch"] == {"all-reduce": 1}  # CPU: the functional all-reduce
    monkeypatch.setattr(execution, "current_stream_pays", lambda device: True)  # as on a GPU
    got = torch.ops.arfusion.all_reduce(x=x.transpose(0, 1), group_name=world_of_one, backend="torch")
    assert torch.equal(got, x.transpose(0, 1)) and got.is_contiguous()
    assert arfusion.stats()["dispatch"] == {"all-reduce": 1, "nccl all-reduce": 1}


# ----------------------------------------------------------------- two gloo ranks against eager


def _against_eager(rank, model_name):
    torch.manual_seed(0)  # the same weights on both ranks: each rank's projection is its shard
    model = {"layernorm": LayerNormBlock, "hyper": HyperConnections}[model_name](HIDDEN)
    torch.manual_seed(1 + rank)
    args = inputs(streams=4 if model_name == "hyper" else None)
    if model_name == "hyper":
        args = (args[0], args[1].clone())
        dist.broadcast(args[1], src=0)  # the residual streams are replicated
    else:
        dist.broadcast(args[1], src=0)
    arfusion.reset_stats()
    with torch.no_grad():
        want = model(*args)
        cfg = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
        got = torch.compile(model, options=arfusion.inductor_options(cfg))(*args)
    err = max(float((g.float() - w.float()).abs().max() / w.float().abs().max()) for g, w in zip(got, want))
    return {"err": err, "fast": arfusion.stats()["fast_path_all_reduces"],
            "dispatch": arfusion.stats()["dispatch"]}


@pytest.mark.multiproc
@pytest.mark.parametrize("model_name", ["layernorm", "hyper"])
@pytest.mark.slow
def test_layernorm_and_hyper_connection_models_match_eager_on_two_ranks(tmp_path, model_name):
    results = collect_from_ranks(functools.partial(_against_eager, model_name=model_name), 2, tmp_path)
    for r in results:
        assert r["err"] < 2e-2 and r["fast"] == 1 and r["dispatch"] == {"torch all-reduce": 1}, r
