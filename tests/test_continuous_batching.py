"""transformers' continuous batching (`generate_batch`, paged attention) with the pass: every site
fused, greedy tokens identical to the same call uncompiled, and the paged-cache graph break named
where arfusion.hf has not removed it.

Most tests run one process over a fake world of 2 ranks (arfusion.testing: graphs as at TP=2,
collectives compute nothing, so compiled and eager runs compute the same thing); the gloo test runs
two real ranks. Models are tiny (arfusion.hf.configs.tiny_config), fp32, random weights, a cache of
64 blocks.
"""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

import arfusion  # noqa: E402
from arfusion import hf  # noqa: E402
from arfusion.check import load_tp_model, save_random_model  # noqa: E402
from arfusion.hf import paged_cache  # noqa: E402
from arfusion.hf.configs import tiny_config  # noqa: E402
from arfusion.testing import assert_fused, fake_world, generate_batch  # noqa: E402

from .helpers import collect_from_ranks  # noqa: E402


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
NEW_TOKENS = 6
PASS = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
PAGED = getattr(transformers.generation.continuous_batching.cache.PagedAttentionCache.update,
                "_torchdynamo_disable", False)


def tiny_tp_model(model_type: str, path: str):
    save_random_model(tiny_config(model_type), path, dtype=torch.float32)
    return load_tp_model(path, 2, dtype=torch.float32)  # prepare_for_compile included


@pytest.fixture
def prepared():
    """keep_paged_cache_in_graph for the test (from scratch), undone afterwards."""
    hf.release_paged_cache()
    yield hf.keep_paged_cache_in_graph()
    hf.release_paged_cache()


# (model type, all-reduces, merged): per-head q/k norms; MoE; Gemma 3 (sliding and full attention:
# two allocators). The dense Llama and Aria (a MoE whose shared expert's all-reduce merges with the
# routed one's) are the continuous-batching sweep's rows, the same harness and assertions
# (tests/test_cb_coverage.py).
FAMILIES = [("qwen3", 5, 0), ("qwen3_moe", 5, 0), ("gemma3_text", 5, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, all_reduces, merged", FAMILIES)
def test_every_site_fuses_and_the_tokens_are_the_eager_ones(prepared, model_type, all_reduces, merged):
    with fake_world(2), tempfile.TemporaryDirectory() as path:
        model = tiny_tp_model(model_type, path)
        eager = generate_batch(model, PROMPTS, NEW_TOKENS, compiled=False)
        run = generate_batch(model, PROMPTS, NEW_TOKENS, config=PASS)
    assert run.tokens == eager.tokens
    assert all(len(t) == NEW_TOKENS for t in run.tokens.values())
    assert not run.report.stats["split_by_graph_breaks"], run.report
    # Per compiled graph (Gemma 3 compiles twice: its two layer kinds' masks change shape).
    per_graph = run.report.all_reduces // run.report.graphs
    assert per_graph == all_reduces and run.report.merged == merged * run.report.graphs, run.report
    assert_fused(run.report, left=0)
    assert set(run.report.stats["dispatch"]) == {"torch"}, run.report.stats["dispatch"]


@pytest.mark.skipif(not PAGED, reason="this transformers traces its paged-cache update as it is")
def test_without_it_the_graph_break_is_named(caplog):
    """transformers' compiled-out update splits every site; the report, stats() and the log name it."""
    hf.release_paged_cache()
    with fake_world(2), tempfile.TemporaryDirectory() as path, caplog.at_level(logging.INFO, "arfusion"):
        save_random_model(tiny_config("llama"), path, dtype=torch.float32)
        model = load_tp_model(path, 2, dtype=torch.float32)
        hf.release_paged_cache()  # load_tp_model prepared it
        run = generate_batch(model, PROMPTS[:1], 2, config=PASS)
    report = run.report
    assert report.fused == 0 and report.all_reduces >= 3, report
    assert report.stats["split_by_graph_breaks"] == {"PagedAttentionCache.update": report.all_reduces}
    assert {r.detail for r in report.rows} == {
        "torch; not fused: a graph break in PagedAttentionCache.update puts its norm in another graph"}
    assert "graph breaks that split sites: PagedAttentionCache.update splits" in str(report)
    named = [r.getMessage() for r in caplog.records if "a graph break in PagedAttentionCache.update (" in r.getMessage()]
    assert len(named) == 1 and "prepare_for_compile" in named[0], named


@pytest.mark.slow
def test_the_next_call_reuses_the_graphs_with_its_new_cache(prepared):
    """Each generate_batch call makes a new cache; the op finds it by its storage, so the graphs
    compiled for the first call serve the second without a recompile, and tokens stay right.
    (Each call compiles with a new pass object of the same config: equal passes, one backend.)"""
    with fake_world(2), tempfile.TemporaryDirectory() as path:
        model = tiny_tp_model("llama", path)
        eager = generate_batch(model, PROMPTS, NEW_TOKENS, compiled=False)
        first = generate_batch(model, PROMPTS, NEW_TOKENS, config=PASS)
        second = generate_batch(model, PROMPTS[::-1], NEW_TOKENS, config=PASS)
    assert first.report.fused == 5 * first.report.graphs >= 5, first.report  # one graph, or two after a recompile
    assert second.report.graphs == 0, second.report
    assert second.tokens == {f"req_{i}": eager.tokens[f"req_{2 - i}"] for i in range(3)}
    assert len(paged_cache._caches) <= 1  # the caches of finished calls are gone


@pytest.mark.slow
def test_eager_runs_compute_what_transformers_computes(prepared):
    """A prepared cache used eagerly runs transformers' own methods: the same tokens as an
    unprepared one."""
    with fake_world(2), tempfile.TemporaryDirectory() as path:
        model = tiny_tp_model("gemma3_text", path)
        ours = generate_batch(model, PROMPTS, NEW_TOKENS, compiled=False)
        hf.release_paged_cache()
        theirs = generate_batch(model, PROMPTS, NEW_TOKENS, compiled=False)
    assert ours.tokens == theirs.tokens and ours.logprobs == theirs.logprobs


def test_the_op_refuses_a_cache_it_does_not_know():
    x = torch.zeros(2, 1, 4)
    with pytest.raises(RuntimeError, match="did not prepare"):
        torch.ops.arfusion.hf_paged_kv_update(x, x, torch.zeros(0, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                               torch.zeros(8), 0)


def test_prepare_is_idempotent_and_says_what_it_found(prepared):
    again = hf.keep_paged_cache_in_graph()
    if PAGED:
        assert prepared == (True, "prepared") and again == (True, "already prepared")
    else:
        assert prepared[0] is False and "nothing to prepare" in prepared[1]


def _two_ranks(rank):
    torch.manual_seed(0)
    results = {}
    for model_type in ("aria_text",):  # Llama at TP=2 on two gloo ranks: tests/test_serve_example.py
        with tempfile.TemporaryDirectory() as path:
            # Rank 0 writes, both load: the ranks agree on the weights.
            if rank == 0:
                save_random_model(tiny_config(model_type), path, dtype=torch.float32)
            shared = [path]
            torch.distributed.broadcast_object_list(shared, src=0)
            model = load_tp_model(shared[0], 2, dtype=torch.float32)
            eager = generate_batch(model, PROMPTS, NEW_TOKENS, compiled=False)
            arfusion.reset_stats()
            run = generate_batch(model, PROMPTS, NEW_TOKENS, config=PASS)
            torch.distributed.barrier()
        results[model_type] = {"same": run.tokens == eager.tokens, "tokens": run.tokens,
                               "fused": run.report.fused, "merged": run.report.merged,
                               "all_reduces": run.report.all_reduces, "dispatch": run.report.stats["dispatch"]}
    return results


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_gloo_ranks_fuse_every_site_with_the_eager_tokens(tmp_path):
    """TP=2 on two gloo ranks (real all-reduces), a model whose MoE all-reduces merge: every
    all-reduce fused or merged, the eager tokens on both ranks. (A dense Llama the same way, against
    the run without the pass: the serving example's test, tests/test_serve_example.py.)"""
    ranks = collect_from_ranks(_two_ranks, 2, tmp_path)
    for rank, results in enumerate(ranks):
        aria = results["aria_text"]
        assert aria["same"] and aria["fused"] + aria["merged"] == aria["all_reduces"] == 7 and aria["merged"] == 2, aria
        assert set(aria["dispatch"]) == {"torch"}, aria
    assert ranks[0]["aria_text"]["tokens"] == ranks[1]["aria_text"]["tokens"]


def test_gpu_check_names_transformers_own_graph_breaks_and_nothing_else():
    """tests/gpu/check_continuous_batching.py: an all-reduce split from its norm by a graph break in
    a listed function of the model's code (Aria's looped experts before transformers 5.24) is
    recorded as transformers' limit; any other split, or more unfused all-reduces than the listed
    breaks explain, stays a problem."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "gpu" / "check_continuous_batching.py"
    spec = importlib.util.spec_from_file_location("check_continuous_batching", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    notes = check.upstream_splits(1, {"sequential_experts_gemm": 1})
    assert len(notes) == 1 and notes[0].startswith("sequential_experts_gemm: ")
    assert check.upstream_splits(2, {"sequential_experts_gemm": 1}) == []  # one unfused all-reduce unexplained
    assert check.upstream_splits(1, {"my_helper": 1}) == []  # a break not listed
    assert check.upstream_splits(1, {"sequential_experts_gemm": 1, "my_helper": 1}) == []
    assert check.upstream_splits(0, {}) == []
