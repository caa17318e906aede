"""`arfusion check` (CPU, one process, a fake process group) and `arfusion.testing.fusion_report`.

The six models are the released checkpoints' config.json values, built from transformers' config
classes (nothing downloaded); `arfusion check` must give, per layer, what the coverage sweep
(docs/data/coverage.json at 8 tokens, coverage_decode.json at 1) recorded for the same model type
at tiny widths: the same fused count, forms, reasons left (by code) and rewrites.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import arfusion
from arfusion import cli
from arfusion.check import CheckError, check_tp_size
from arfusion.hf import experts_need_expert_parallel
from arfusion.decisions import Fate, Why
from arfusion.testing import FusionReport, Row, assert_fused, fake_world, fusion_report

from .helpers import stderr_for_a_user

ROOT = Path(__file__).resolve().parents[1]
COVERAGE = {8: ROOT / "docs" / "data" / "coverage.json", 1: ROOT / "docs" / "data" / "coverage_decode.json"}
# On an idle 2-core machine `arfusion check` takes about its CPU time (compiling is one thread):
# bound that, which other work on the machine does not inflate as it does the wall time.
CPU_SECONDS = 60

# model type -> (checkpoint, its config.json's values)
MODELS = {
    "llama": ("Llama-3-8B", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3-30B-A3B", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "deepseek_v2": ("DeepSeek-V2-Lite", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        tie_word_embeddings=False)),
    "gemma3_text": ("Gemma-3-12B", dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, query_pre_attn_scalar=256, vocab_size=262208, sliding_window=1024, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "cohere": ("Command-R (c4ai-command-r-v01)", dict(
        hidden_size=8192, intermediate_size=22528, num_hidden_layers=40, num_attention_heads=64,
        num_key_value_heads=64, vocab_size=256000, logit_scale=0.0625, rope_theta=8000000.0, layer_norm_eps=1e-5,
        use_qk_norm=False, max_position_embeddings=131072, tie_word_embeddings=True)),
    "granite": ("Granite-3.1-8B", dict(
        hidden_size=4096, intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=49155, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
        logits_scaling=16.0, rope_theta=10000000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
}
# Where the 2 layers kept differ from the sweep's: DeepSeek-V2-Lite's first layer is dense
# (first_k_dense_replace=1), DeepseekV2Config's default has none, so the check has 1 MoE layer where
# the sweep has 2. The rewrites of a MoE block then count once, not twice.
MOE_LAYERS = {"deepseek_v2": (1, 2)}  # (check, sweep)
MOE_REWRITES = ("summed_all_reduces_merged", "gated_all_reduces_merged", "sums_moved_before_all_reduce",
                "moe_combines_fused")


def _expected(model_type: str, tokens: int) -> dict:
    """The sweep's row for the model type, per layer as the check's 2 layers have them."""
    row = next(r for r in json.loads(COVERAGE[tokens].read_text())["rows"] if r["model_type"] == model_type)
    check_moe, sweep_moe = MOE_LAYERS.get(model_type, (1, 1))
    rewrites = {k: v * check_moe // sweep_moe if k in MOE_REWRITES else v for k, v in row["rewrites"].items()}
    want = {"fused": row["fused"], "by_pattern": row["by_pattern"], "why_not_codes": row["why_not_codes"],
            "rewrites": rewrites, "graphs": row["graphs"], "unfused_sites": row["unfused_sites"]}
    if "all_reduces" in row:  # the per-all-reduce split, in rows swept since it was added
        merged = row["merged"] * check_moe // sweep_moe
        want.update(all_reduces=row["all_reduces"] - row["merged"] + merged, merged=merged,
                    fast_path=row["fast_path"], left_nccl=row["left_nccl"], nccl_codes=row["nccl_codes"])
    return want


def _write_config(model_type: str, directory: Path) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **MODELS[model_type][1]).save_pretrained(directory)
    return directory


# Through the CLI, at the released configs' sizes: the MoE with MLA and merged all-reduces, Gemma's
# norm, a LayerNorm model (no site: the fast path) and Granite's scaled sites. Llama and Qwen3-MoE
# are compared with the same sweep rows through the same code by tests/test_hf_coverage.py.
CLI_MODELS = ("deepseek_v2", "gemma3_text", "cohere", "granite")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", CLI_MODELS)
def test_check_gives_the_coverage_sweeps_verdict(model_type, tmp_path):
    """`arfusion check <directory with the checkpoint's config.json>`, as a user runs it."""
    import transformers

    path = _write_config(model_type, tmp_path / "model")
    out = tmp_path / "check.json"
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "arfusion.cli", "check", str(path), "--json", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    cpu1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - wall0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert stderr_for_a_user(done.stderr) == [], done.stderr[-3000:]  # no warning, ours or known noise
    result = json.loads(out.read_text())
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == result["verdict"] and lines[0] == result["header"]
    assert f"hidden {MODELS[model_type][1]['hidden_size']}" in lines[0] and ": 2 of " in lines[0]
    by_ep = experts_need_expert_parallel(transformers.AutoConfig.for_model(model_type))  # DeepSeek on >= 5.25
    assert ("experts sharded by expert parallelism over the 2 ranks" in lines[0]) == by_ep, lines[0]
    # What a user sees is checked on any transformers; the rows only against the release the
    # committed sweeps ran on (another release's model code may differ).
    swept_on = {json.loads(p.read_text())["meta"]["transformers"] for p in COVERAGE.values()}
    if swept_on != {transformers.__version__}:
        pytest.skip(f"the committed sweeps ran on transformers {', '.join(sorted(swept_on))}, this is "
                    f"{transformers.__version__}: the CLI ran cleanly, its rows are not compared")
    for report in result["reports"]:
        want = _expected(model_type, report["tokens"])
        got = {k: report[k] for k in want}
        assert got == want, (report["tokens"], result["verdict"])
        merged = want["rewrites"].get("summed_all_reduces_merged", 0)
        total = want["fused"] + merged + want["unfused_sites"]
        assert report["verdict"].startswith(f"{want['fused']} of {total} all-reduces fused"), report["verdict"]
        assert [r["code"] for r in report["rows"] if Fate(r["fate"]) is Fate.MERGED] == [Why.MERGED.value] * merged
        for row in report["rows"]:  # the verdicts name why each all-reduce left was not fused
            if Fate(row["fate"]) not in (Fate.FUSED, Fate.MERGED):
                assert row["detail"] in report["verdict"] and row["detail"] in result["verdict"], row
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    print(f"{MODELS[model_type][0]}: wall {wall:.1f} s, CPU {cpu:.1f} s; {result['verdict']}")
    assert cpu < CPU_SECONDS, f"{MODELS[model_type][0]}: {cpu:.0f} s of CPU (wall {wall:.0f} s)"


@pytest.mark.slow
def test_check_a_model_type_with_an_fp8_quant_fuses_the_quant(capsys, monkeypatch):
    """A model type (its config class's defaults), in this process, with --quant."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["check", "qwen3", "--tokens", "8", "--quant", "fp8-dynamic", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "fp8-dynamic activation quant" in out.splitlines()[0]
    assert out.strip().splitlines()[-1].startswith("qwen3: 5 of 5 all-reduces fused"), out
    assert "allreduce_add_rmsnorm_fp8_dynamic" in out, out
    assert not dist.is_initialized()  # the check's fake process group is gone


# ------------------------------------------------------------------------- bad input: one line, exit 2
def _bad(capsys, monkeypatch, *argv) -> str:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["check", *argv, "--quiet"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and err.startswith("arfusion check: "), captured
    return err


def test_an_unknown_model_type(capsys, monkeypatch):
    err = _bad(capsys, monkeypatch, "lama")
    assert "unknown model type 'lama'" in err and "did you mean" in err and "llama" in err


def test_a_directory_without_a_config(capsys, monkeypatch, tmp_path):
    assert "no config.json" in _bad(capsys, monkeypatch, str(tmp_path))
    assert "not a directory" in _bad(capsys, monkeypatch, str(tmp_path / "missing" / "model"))


def test_a_model_type_without_a_tp_plan(capsys, monkeypatch):
    assert "model type 'gpt2' has no tensor-parallel plan" in _bad(capsys, monkeypatch, "gpt2")


def test_a_model_that_does_not_load(capsys, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                       "intermediate_size": -5, "num_attention_heads": 4}))
    assert "llama does not load with its TP plan at TP=2" in _bad(capsys, monkeypatch, str(tmp_path))
    assert not dist.is_initialized()


def test_a_config_json_that_is_not_json(capsys, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json" in _bad(capsys, monkeypatch, str(tmp_path))


def test_a_json_path_that_cannot_be_written(capsys, monkeypatch, tmp_path):
    """Said before the model is built, not after minutes of compiling."""
    monkeypatch.setattr(cli.check, "check", lambda *a, **k: pytest.fail("the model was built"))
    missing = tmp_path / "missing" / "check.json"
    assert _bad(capsys, monkeypatch, "llama", "--json", str(missing)) == \
        f"arfusion check: --json {missing}: no directory {missing.parent}"
    assert _bad(capsys, monkeypatch, "llama", "--json", str(tmp_path)).endswith(": is a directory")


def test_check_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "every all-reduce of a Hugging Face model" in out
    assert "hf_coverage" not in out and "save_random_model" not in out


def test_a_tp_size_the_model_cannot_take(capsys, monkeypatch):
    """Llama's 32 heads over TP=3: one line before loading, not Dynamo's trace from compiling."""
    err = _bad(capsys, monkeypatch, "llama", "--tp", "3")
    assert err == ("arfusion check: llama: 32 attention heads (num_attention_heads) do not split over TP=3 "
                   "(the TP plan shards them); --tp 2, 4, 8 or 16 would fit")
    assert not dist.is_initialized()


@pytest.mark.multiproc
def test_a_tp_size_the_model_cannot_take_as_a_user_runs_it():
    """The whole of stderr is the reason: no trace, and no torchao lines about its CUDA extensions."""
    done = subprocess.run([sys.executable, "-m", "arfusion.cli", "check", "llama", "--tp", "3"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "arfusion check: llama: 32 attention heads (num_attention_heads) do not split over TP=3 "
        "(the TP plan shards them); --tp 2, 4, 8 or 16 would fit"], done.stderr


def test_the_released_models_split_over_tp_2_and_4():
    from transformers import AutoConfig

    for model_type, (_, values) in MODELS.items():
        for tp in (2, 4):
            check_tp_size(AutoConfig.for_model(model_type, **values), model_type, tp)


@pytest.mark.parametrize("model_type, changes, tp, reason", [
    ("qwen3_moe", {}, 8, "qwen3_moe: 4 key/value heads (num_key_value_heads) do not split over TP=8 "
                         "(the TP plan shards them); --tp 2 or 4 would fit"),
    ("cohere", {}, 3, "cohere: 64 attention heads (num_attention_heads) do not split over TP=3 "
                      "(the TP plan shards them); --tp 2, 4, 8 or 16 would fit"),
    ("granite", {"num_key_value_heads": 1}, 2,
     "granite: 1 key/value head (num_key_value_heads) does not split over TP=2 (the TP plan shards it)"),
])
def test_the_tp_size_check_names_the_first_width_that_does_not_split(model_type, changes, tp, reason):
    """Heads and the experts' widths must split evenly; a dense MLP's width and the vocabulary
    may not (transformers splits them unevenly, and that runs): those are not checked."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**MODELS[model_type][1], **changes})
    with pytest.raises(CheckError) as raised:
        check_tp_size(config, model_type, tp)
    assert str(raised.value) == reason


def test_the_tp_size_check_follows_how_the_experts_are_sharded():
    """Experts sharded by the TP plan (transformers <= 5.24): each expert's intermediate size must
    split. Left whole by it and sharded by expert parallelism over the TP ranks (>= 5.25, tp_kwargs):
    the routed experts' count must, and the intermediate size need not."""
    from transformers import AutoConfig

    values = MODELS["qwen3_moe"][1]
    by_ep = experts_need_expert_parallel(AutoConfig.for_model("qwen3_moe"))
    odd_width = AutoConfig.for_model("qwen3_moe", **{**values, "moe_intermediate_size": 770})
    odd_count = AutoConfig.for_model("qwen3_moe", **{**values, "num_experts": 126})
    fits, fails = (odd_width, odd_count) if by_ep else (odd_count, odd_width)
    check_tp_size(fits, "qwen3_moe", 4)
    with pytest.raises(CheckError) as raised:
        check_tp_size(fails, "qwen3_moe", 4)
    assert str(raised.value) == (
        "qwen3_moe: 126 routed experts (num_experts) do not split over TP=4 (expert parallelism over the TP ranks "
        "shards them); --tp 2 would fit" if by_ep else
        "qwen3_moe: the experts' intermediate size, 770 (moe_intermediate_size), does not split over TP=4 "
        "(the TP plan shards it); --tp 2 would fit")


def test_bad_arguments(capsys, monkeypatch):
    assert "--tokens" in _bad(capsys, monkeypatch, "llama", "--tokens", "1,x")
    assert "--tp must be at least 2" in _bad(capsys, monkeypatch, "llama", "--tp", "1")


# ------------------------------------------------------------------------- fusion_report (library)
def _torch_tp_example():
    path = ROOT / "examples" / "compile_torch_tp.py"
    spec = importlib.util.spec_from_file_location("compile_torch_tp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Dynamo imports the module of the code it traces
    spec.loader.exec_module(module)
    return module


def _torch_tp_decoder(experts: int = 0, sequence_parallel: bool = False):
    """The example's decoder under parallelize_module on a 1-D mesh over the current world."""
    from torch.distributed.device_mesh import init_device_mesh

    args = argparse.Namespace(layers=1, hidden=64, vocab=128, dtype="bf16", norm="rmsnorm",
                              sequence_parallel=sequence_parallel, experts=experts)
    return _torch_tp_example().build(args, init_device_mesh("cpu", (dist.get_world_size(),)), torch.device("cpu"))


IDS = torch.arange(8).view(1, 8)


def test_fusion_report_on_a_torch_native_tp_model():
    """parallelize_module (torchtitan's plan) in a fake world of 2: the embedding's all-reduce and
    those of o_proj and down_proj fuse; stats, Inductor's config, the logger are left as found."""
    log = logging.getLogger("arfusion")
    level, slot = log.level, torch._inductor.config.post_grad_custom_post_pass
    before = arfusion.stats()["fused_sites"]
    with fake_world(2) as world:
        assert world == 2
        report = fusion_report(_torch_tp_decoder(), (IDS,))
        assert dist.is_initialized()  # fusion_report used this world and left it
    assert not dist.is_initialized()
    assert report.verdict == "3 of 3 all-reduces fused", str(report)
    assert report.forms == {"allreduce_rmsnorm_fp32_weight": 1, "allreduce_add_rmsnorm_fp32_weight": 2}
    assert [r.fate for r in report.rows] == [Fate.FUSED] * 3 and report.graphs == 1
    report.assert_all_fused()
    assert_fused(report, all_reduces=3, fused=3, left=0)
    assert "verdict: 3 of 3 all-reduces fused" in str(report) and "allreduce_add_rmsnorm_fp32_weight" in str(report)
    assert report.output.shape == (1, 8, 128)
    assert arfusion.stats()["fused_sites"] == before + 3  # added to, not reset
    assert log.level == level and torch._inductor.config.post_grad_custom_post_pass is slot
    with pytest.raises(AssertionError) as failure:
        assert_fused(report, fused=4, forms={"allreduce_add_rmsnorm": 3})
    text = str(failure.value)
    assert "fused: expected 4, got 3" in text and "forms: expected" in text
    assert "verdict: 3 of 3 all-reduces fused" in text  # the report itself follows


@pytest.mark.slow
def test_fusion_report_names_merged_and_left_all_reduces():
    """A dense MoE parallelized per expert: 4 all-reduces per layer become 1 (3 merged into it);
    sequence parallelism has no all-reduce at all, and the report says why."""
    with fake_world(2):
        moe = fusion_report(_torch_tp_decoder(experts=4), (IDS,))
        sp = fusion_report(_torch_tp_decoder(sequence_parallel=True), (IDS,))
    assert moe.verdict == "3 of 6 all-reduces fused, 3 merged into another", str(moe)
    assert moe.rewrites == {"summed_all_reduces_merged": 3, "gated_all_reduces_merged": 3}
    merged = [r for r in moe.rows if r.fate is Fate.MERGED]  # the pass names the all-reduces it folded
    assert len(merged) == 3 and all(r.code == Why.MERGED.value and r.all_reduce.startswith("all_reduce")
                                    for r in merged)
    moe.assert_all_fused()
    assert sp.rows == [] and sp.verdict.startswith("no all-reduce to fuse: "), sp.verdict
    assert sp.stats["why_not_codes"] == {Why.SEQUENCE_PARALLEL.value: 3}, sp.stats  # one per reduce-scatter
    with pytest.raises(AssertionError, match="no all-reduce to fuse"):
        sp.assert_all_fused()


class _Block(torch.nn.Module):
    """all_reduce -> + residual -> RMSNorm, then an all-reduce that reaches no norm."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, x, residual):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        y = F.rms_norm(h, (64,), self.weight, 1e-6)
        return funcol.all_reduce(y @ y.transpose(-1, -2), "sum", dist.group.WORLD)


def test_fusion_report_keeps_its_info_lines_from_the_users_handlers():
    """As after logging.basicConfig(level=WARNING): the report reads the arfusion logger's INFO
    lines, the user's handler gets only its warnings; the logger is left as found, also after an error."""
    from arfusion import testing

    root, log = logging.getLogger(), logging.getLogger("arfusion")
    users, root_level, level = testing.LogLines(logging.NOTSET), root.level, log.level
    root.addHandler(users)
    root.setLevel(logging.WARNING)
    log.setLevel(logging.NOTSET)
    try:
        x, r = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
        report = fusion_report(_Block().to(torch.bfloat16), (x, r))
        assert report.log and users.lines == [], users.lines
        with pytest.raises(RuntimeError), testing._arfusion_log() as lines:
            log.info("arfusion: an info line")
            log.warning("arfusion: a warning")
            raise RuntimeError
        assert lines == ["arfusion: an info line", "arfusion: a warning"]
        assert users.lines == ["arfusion: a warning"]
        assert log.propagate and log.level == logging.NOTSET and log.handlers == []
    finally:
        root.removeHandler(users)
        root.setLevel(root_level)
        log.setLevel(level)


def test_fusion_report_makes_a_fake_world_only_where_there_is_none():
    x, r = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    report = fusion_report(_Block().to(torch.bfloat16), (x, r), world_size=4)
    assert not dist.is_initialized()
    first, second = report.rows
    assert (first.fate, first.code, first.detail) == (Fate.FUSED, None, "allreduce_add_rmsnorm_fp32_weight")
    # The second is the block's output: no norm reads it; the torch backend's fast path takes it.
    assert (second.fate, second.code) == (Fate.FAST_PATH, Why.GRAPH_OUTPUT.value)
    assert report.all_reduces == 2 and report.fused == 1
    assert report.verdict.startswith("1 of 2 all-reduces fused, 1 ")
    with pytest.raises(AssertionError, match="left \\(not fused, not merged\\): expected 0, got 1"):
        report.assert_all_fused()


def test_rows_from_decisions_number_the_graphs_and_keep_the_codes():
    decisions = [{"graph": "g1", "all_reduce": "all_reduce", "fate": "fused", "code": None,
                  "detail": "allreduce_rmsnorm"},
                 {"graph": "g2", "all_reduce": "all_reduce", "fate": "nccl", "code": "no_norm", "detail": "why"},
                 {"graph": "g2", "all_reduce": "all_reduce_1", "fate": "merged", "code": "merged", "detail": "into"}]
    report = FusionReport(arfusion.testing.rows_from(decisions))
    assert report.rows == [Row(1, "all_reduce", Fate.FUSED, None, "allreduce_rmsnorm"),
                           Row(2, "all_reduce", Fate.NCCL, "no_norm", "why"),
                           Row(2, "all_reduce_1", Fate.MERGED, "merged", "into")]
    assert report.left_codes == {"no_norm": 1}
    assert report.verdict == "1 of 3 all-reduces fused, 1 merged into another, 1 left: why"


def test_without_kernels_the_same_decisions_and_output_as_a_full_compile(world_of_one, monkeypatch):
    """arfusion.graph_only: Inductor up to its post-grad passes, then the rewritten graph run op by
    op. On a real group (a world of one: the all-reduce computes) its decisions and its output are
    those of Inductor's whole compile; where torch lacks the internals it uses, a full compile."""
    from arfusion import graph_only
    from arfusion.testing import compile_and_run

    torch.manual_seed(0)
    block = _Block().to(torch.bfloat16)
    x, r = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
    built = []
    monkeypatch.setattr(graph_only, "backend", lambda options, make=graph_only.backend: built.append(1) or make(options))
    with torch.no_grad():
        full = compile_and_run(block, (x, r), config=config)
        assert not built
        unlowered = compile_and_run(block, (x, r), config=config, kernels=False)
    assert built == [1]
    assert unlowered.rows == full.rows, (unlowered, full)
    assert [(row.fate, row.code) for row in full.rows] == [(Fate.FUSED, None), (Fate.FAST_PATH, Why.GRAPH_OUTPUT.value)]
    assert unlowered.stats["dispatch"] == full.stats["dispatch"] == {"torch": 1, "torch all-reduce": 1}, full.stats
    for a, b in zip(unlowered.output, full.output):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)  # Inductor's kernels vs aten's: bf16 rounding
    monkeypatch.setattr(graph_only, "_steps", lambda: None)  # a torch without the internals
    assert graph_only.backend({}) is None
    with torch.no_grad():
        fallback = compile_and_run(block, (x, r), config=config, kernels=False)
    assert fallback.rows == full.rows


def test_fusion_report_builds_no_kernels_under_a_fake_group(monkeypatch):
    """Nothing computes under the fake process group: fusion_report stops Inductor after its
    post-grad passes (arfusion.graph_only). Inductor never lowers a graph."""
    from torch._inductor.graph import GraphLowering

    def refuse(*args, **kwargs):
        raise AssertionError("Inductor lowered a graph under a fake process group")

    monkeypatch.setattr(GraphLowering, "__init__", refuse)
    x, r = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    report = fusion_report(_Block().to(torch.bfloat16), (x, r))
    assert report.fused == 1 and report.stats["dispatch"] == {"torch": 1, "torch all-reduce": 1}, report


def test_check_loads_as_rank_zero_of_torchrun(monkeypatch):
    """On a CUDA machine transformers picks the GPU of a tensor-parallel load from LOCAL_RANK
    (a KeyError where it is unset): `arfusion check` loads under `fake_world`, which sets RANK,
    LOCAL_RANK and WORLD_SIZE as torchrun does for rank 0, and leaves the environment as it was."""
    import os

    from arfusion import check as check_module

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    seen = {}

    def load(config, tp):
        seen.update({key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")})
        raise CheckError("stop here")

    monkeypatch.setattr(check_module, "load_tp_model", load)
    with pytest.raises(CheckError, match="stop here"):
        check_module.check("llama", tp=4, show_progress=False)
    assert seen == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & set(os.environ)
