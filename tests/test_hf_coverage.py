"""benchmarks/coverage/hf_coverage.py: the HF architecture sweep on a few fast architectures, and its
independent site counter (benchmarks/coverage/hf_site_counter.py) on hand-written chains.

The sweep test runs 5 architectures on 2 gloo ranks (about 110 s on a 2-core CPU) and compares each
row with the committed sweep (docs/data/coverage.json) in every field but timings, errors and the
messages for people: those tests are `slow` and `multiproc`; the counter's own tests are quick.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "data" / "coverage.json"  # the full sweep, at the sweep's default token count
sys.path.insert(0, str(ROOT / "benchmarks" / "coverage"))

import coverage_report  # noqa: E402
import hf_coverage  # noqa: E402
from hf_site_counter import SiteCounter, classify_norms, norm_kind  # noqa: E402

from .models import looped_longcat_experts  # noqa: E402

LAYERS = 2
SWEEP = ("llama", "olmo2", "qwen3_moe", "granite", "longcat_flash")
# What the independent counter finds in the eager models (2 layers).
EXPECTED_SITES = {
    "llama": 2 * LAYERS + 1,      # embedding AR -> norm, then AR + residual -> norm per block
    "qwen3_moe": 2 * LAYERS + 1,  # the MoE all-reduce reaches the add through a view
    "olmo2": 2 * LAYERS,          # post-norms: AR -> norm (no residual in between)
    "granite": 2 * LAYERS + 1,    # residual_multiplier (0.22, as released) scales every all-reduce before the add
    # two sublayers per layer: the embedding AR, then attention and dense-MLP ARs + residual; the
    # shortcut MoE's AR and the second MLP's are summed with the residual ("ar+ar+add", not counted)
    "longcat_flash": 1 + 3 * LAYERS,
}
# Every site the counter finds is fused: OLMo2 multiplies the weight in fp32 with one cast,
# Qwen3-MoE views the all-reduced rows before the add; Granite's multipliers go into the op.
# LongCat-Flash: plus the two "ar+ar+add" ends, each one all-reduce once merged.
EXPECTED_FUSED = {**EXPECTED_SITES, "longcat_flash": 1 + 4 * LAYERS}
# A row's fields a fresh sweep may give otherwise than the committed one: times, errors (the CPU's
# float kernels; bounded in test_fused_counts) and messages for people (reworded freely; the
# reasons are compared by code: why_not_codes, nccl_codes).
NOT_COMPARED = {"eager_s", "compile_s", "pass_s", "seconds",
                "err_compile_vs_eager", "err_pass_vs_compile", "err_pass_vs_eager",
                "why_not", "not_fused_log", "log"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("coverage")
    md, js = out / "coverage.md", out / "coverage.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "coverage" / "hf_coverage.py"), "--only", ",".join(SWEEP),
           "--md", str(md), "--json", str(js), "--log", str(out / "ranks.log"), "--quiet", "--timeout", "150"]
    # --timeout bounds each architecture; this only catches a driver that hangs itself
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(js.read_text())
    return {"md": md.read_text(), "rows": {r["model_type"]: r for r in data["rows"]}, "data": data,
            "log": (out / "ranks.log").read_text()}


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_architecture_completed(sweep):
    assert set(sweep["rows"]) == set(SWEEP)
    failed = {m: r["error"] for m, r in sweep["rows"].items() if r.get("error")}
    assert not failed, (failed, sweep["log"][-3000:])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", SWEEP)
def test_counter_sites(sweep, model_type):
    row = sweep["rows"][model_type]
    assert row["sites"] == EXPECTED_SITES[model_type], row["counter"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_counter_sees_the_lookalikes(sweep):
    rows = sweep["rows"]
    # Granite: every all-reduce is scaled by a number before the add (sites: the op takes the factor).
    assert rows["granite"]["counter"]["site_labels"] == {"ar*s": 1, "ar*s+add": 2 * LAYERS}
    assert rows["granite"]["rewrites"]["scaled_all_reduces_fused"] == 2 * LAYERS + 1
    # OLMo2 (post-norm): the embedding's all-reduce reaches the final norm through the residual chain.
    assert rows["olmo2"]["counter"]["other_shapes"] == {f"ar+add×{2 * LAYERS}": 1}
    assert rows["llama"]["counter"]["site_labels"] == {"ar": 1, "ar+add": 2 * LAYERS}


@pytest.mark.slow
@pytest.mark.multiproc
def test_longcat_flash_compiles_whole(sweep):
    """transformers <= 5.24: LongCat-Flash's experts loop over the experts hit (a graph break per
    MoE layer) until arfusion.hf.prepare_for_compile gives them the loop-free forward: one graph,
    each layer's residual + AR(mlp) + AR(shortcut MoE) one all-reduce, the top-k combine fused into
    it. >= 5.25: transformers' experts interface, no loop, the experts sharded by expert parallelism
    (tp_kwargs); their output and its all-reduce stay fp32 (the router's weights), so those two
    all-reduces are declined by code (another dtype than the residual's) and take the fast path."""
    row = sweep["rows"]["longcat_flash"]
    assert row["graphs"] == 1, row
    if looped_longcat_experts():
        assert row["why_not_codes"] == {}, row
        assert row["rewrites"] == {"summed_all_reduces_merged": LAYERS, "moe_combines_fused": LAYERS}, row
        assert row["counter"]["other_shapes"] == {"ar+ar+add": LAYERS}, row["counter"]
    else:
        assert row["why_not_codes"] == {"residual_dtype": LAYERS} and row["rewrites"] == {}, row
        assert row["counter"]["other_shapes"] == {"ar+ar+replicated+add": LAYERS}, row["counter"]
        assert (row["fast_path"], row["left_nccl"]) == (LAYERS, 0), row


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", SWEEP)
def test_fused_counts(sweep, model_type):
    row = sweep["rows"][model_type]
    assert "fused" in row and "err_pass_vs_compile" in row and "err_compile_vs_eager" in row, row
    assert row["fused"] == EXPECTED_FUSED[model_type], row
    if row["fused"] == 0:
        assert row["err_pass_vs_compile"] == 0.0  # nothing rewritten: the same compiled graph
    assert row["err_pass_vs_compile"] < 2e-2 and row["err_compile_vs_eager"] < 2e-2, row


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", SWEEP)
def test_rows_match_the_committed_sweep(sweep, model_type):
    """What the pass does with each model is what the committed sweep recorded: sites, fused,
    forms, the all-reduce split, reasons by code, rewrites, graphs, the counter's findings."""
    committed = json.loads(COMMITTED.read_text())
    assert committed["meta"]["tokens"] == sweep["data"]["meta"]["tokens"]
    if committed["meta"]["transformers"] != sweep["data"]["meta"]["transformers"]:
        pytest.skip(f"the committed sweep ran on transformers {committed['meta']['transformers']}, this on "
                    f"{sweep['data']['meta']['transformers']}: its model code may differ")
    want = next(r for r in committed["rows"] if r["model_type"] == model_type)
    got = sweep["rows"][model_type]
    assert {"why_not_codes", "nccl_codes", "all_reduces"} <= set(want), sorted(want)  # swept with codes
    assert {k: v for k, v in got.items() if k not in NOT_COMPARED} == \
        {k: v for k, v in want.items() if k not in NOT_COMPARED}


@pytest.mark.slow
@pytest.mark.multiproc
def test_table_rows_and_summary(sweep):
    md = sweep["md"]
    assert coverage_report.ROW_HEADER in md
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([^`]+)` \|", line).group(1) for line in rows] == list(SWEEP)
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 10, line
        assert cells[1].isdigit() and cells[2].isdigit(), line
        split = re.fullmatch(r"(\d+): (\d+) / (\d+) / (\d+) / (\d+)", cells[3])  # fused / merged / fast / NCCL
        assert split and int(split[1]) == sum(int(n) for n in split.groups()[1:]), line
        assert re.fullmatch(r"\d\.\de[+-]\d\d", cells[6]) and re.fullmatch(r"\d\.\de[+-]\d\d", cells[7]), line
    assert re.search(r"\*\*5 architectures, \d+ sites \(counter\), \d+ fused, \d+ fully fused\*\*", md)
    assert re.search(r"Of their \d+ all-reduces, \d+ fused into sites, \d+ merged into another, \d+ on the fast path, "
                     r"0 left on NCCL", md)
    assert "## How the counter works" in md
    assert coverage_report.table_row(sweep["rows"]["llama"]) in md


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_update_keeps_the_sweeps_header_and_names_what_it_reran(sweep, tmp_path):
    first = sweep["data"]["meta"]
    run = {**first, "command": "python benchmarks/coverage/hf_coverage.py --only llama", "date": "2030-01-02 03:04",
           "wall_s": 30.0, "commit": "abc1234"}
    meta = coverage_report.with_update(first, run, ["llama"])
    meta = coverage_report.with_update(meta, {**run, "commit": "def5678"}, ["olmo2"])
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    coverage_report.write_reports(sweep["data"]["rows"], md, js, meta)
    text = md.read_text()
    assert f"- date: {first['date']};" in text and f"(commit {first['commit']})" in text
    assert "- rows `llama` rerun: `python benchmarks/coverage/hf_coverage.py --only llama --update`, 2030-01-02 03:04, " \
           "0.5 min" in text and "(commit abc1234)" in text
    assert "- rows `olmo2` rerun:" in text and "(commit def5678)" in text
    assert json.loads(js.read_text())["meta"]["updates"][1]["rows"] == ["olmo2"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_token_count_is_in_the_header_and_an_update_refuses_another(sweep, tmp_path):
    """--tokens 1 (a decode step's shape) is named in the header; rows of another token count are
    never mixed into a report (--update refuses, and writes nothing)."""
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    coverage_report.write_reports(sweep["data"]["rows"], md, js, {**sweep["data"]["meta"], "tokens": 1})
    assert "1 × 1 tokens" in md.read_text()
    md.unlink()
    code = hf_coverage.main(["--only", "llama", "--update", "--json", str(js), "--md", str(md), "--tokens", "8",
                             "--quiet"])
    assert code == 2 and not md.exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hung_architecture_is_killed_and_recorded(tmp_path):
    """One rank hangs: the driver kills the pair past --timeout, records the row, leaves no rank behind."""
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "coverage" / "hf_coverage.py"), "--only", "llama", "--md", str(md),
           "--json", str(js), "--log", str(tmp_path / "ranks.log"), "--quiet", "--timeout", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_COVERAGE_TEST_HANG": "llama"})
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(js.read_text())["rows"]
    assert row["error"].startswith("timeout"), row
    assert "| `llama` | - | - |" in md.read_text()
    assert not hf_coverage.processes_with_env(b"HF_COVERAGE_TEST_HANG=llama")


def test_only_writes_to_a_temporary_directory(tmp_path, monkeypatch, capsys):
    """--only without --update never replaces the committed full sweep; --md/--json given are kept."""
    monkeypatch.setattr(hf_coverage.tempfile, "tempdir", str(tmp_path))
    args = hf_coverage.parse_args(["--only", "llama"])
    assert Path(args.md).parent == Path(args.json).parent and Path(args.md).parent.parent == tmp_path
    assert str(Path(args.md).parent) in capsys.readouterr().err
    args = hf_coverage.parse_args(["--only", "llama", "--md", "x.md"])
    assert args.md == "x.md" and Path(args.json).parent.parent == tmp_path
    assert hf_coverage.parse_args(["--only", "llama", "--update"]).json == str(COMMITTED)
    args = hf_coverage.parse_args([])
    assert (args.md, args.json) == (str(ROOT / "docs" / "coverage.md"), str(COMMITTED))


# ------------------------------------------------------------------------- the counter alone
class RMSNorm(torch.nn.Module):  # Llama's spelling
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))
        self.variance_epsilon = eps

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    def forward(self, x, gate=None):
        y = super().forward(x)
        return y if gate is None else y * torch.nn.functional.silu(gate)


class Toy(torch.nn.Module):
    """Each norm sees one provenance: ar, ar+add, ar+ar+add, ar*s+add, ar+replicated+add, ar*g+add,
    a dtype cast, ar+ar, a gated norm, a LayerNorm."""

    def __init__(self, h=16):
        super().__init__()
        self.n = torch.nn.ModuleList(RMSNorm(h) for _ in range(10))
        self.gated = GatedRMSNorm(h)
        self.ln = torch.nn.LayerNorm(h)

    @staticmethod
    def ar(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    def forward(self, x):
        r = x.clone()
        a = self.n[0](self.ar(x))                                   # ar
        b = self.n[1](r + self.ar(x.reshape(-1, x.shape[-1])).view(x.shape))  # ar [view] + residual
        c = self.n[2]((self.ar(x) + self.ar(x)) + r)                # routed + shared experts
        d = self.n[3](r + self.ar(x) * 0.5)                         # Granite
        e = self.n[4]((self.ar(x) + x * 2) + r)                     # replicated shared expert
        f = self.gated(self.ar(x) + r, x)                           # gated norm: look-alike
        g = self.ln(self.ar(x) + r)                                 # LayerNorm: look-alike
        h = self.n[6](r + self.ar(x) * torch.sigmoid(x[..., :1]))   # per-token gate (Qwen3-Next's shared expert)
        i = self.n[7](self.ar(x).float().to(x.dtype) + r)           # a dtype round trip on the way
        j = self.n[8](self.ar(x) + self.ar(x))                      # MoE block's own post-norm, no residual
        k = self.n[9](r + self.ar(x) * 1.0)                         # a multiplier left at 1.0: no scale
        return a + b + c + d + e + f + g + h + i + j + k + self.n[5](x)  # n[5]: no all-reduce


def test_counter_labels_each_shape(world_of_one):
    model = Toy()
    kinds = classify_norms(model, 16)
    assert kinds["gated"] == "rmsnorm" and kinds["ln"] == "layernorm"
    counter = SiteCounter()
    counter.hook_norms(model, kinds)
    with torch.no_grad(), counter:
        model(torch.randn(2, 3, 16, dtype=torch.bfloat16))
    counter.remove_hooks()
    labels = {c["module"]: (c["kind"], c["label"]) for c in counter.norm_calls}
    assert labels == {
        "n.0": ("rmsnorm", "ar"), "n.1": ("rmsnorm", "ar+add"), "n.2": ("rmsnorm", "ar+ar+add"),
        "n.3": ("rmsnorm", "ar*s+add"), "n.4": ("rmsnorm", "ar+replicated+add"),
        "gated": ("rmsnorm gated", "ar+add"), "ln": ("layernorm", "ar+add"), "n.5": ("rmsnorm", None),
        "n.6": ("rmsnorm", "ar*g+add"), "n.7": ("rmsnorm", "ar+add (dtype cast)"), "n.8": ("rmsnorm", "ar+ar"),
        "n.9": ("rmsnorm", "ar+add")}
    s = counter.summary()
    assert s["sites"] == 5 and s["site_labels"] == {"ar": 1, "ar+add": 2, "ar+ar": 1, "ar*s+add": 1}
    assert s["all_reduces"] == 13 and s["all_reduces_not_reaching_a_norm"] == {}
    assert s["other_shapes"] == {"ar+ar+add": 1, "ar+replicated+add": 1, "ar*g+add": 1,
                                 "ar+add (dtype cast)": 1}
    assert s["gated_norm_lookalikes"] == {"ar+add": 1} and s["layernorm_lookalikes"] == {"ar+add": 1}


def test_norm_kind_by_what_it_computes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert norm_kind(LlamaRMSNorm(32), 32) == "rmsnorm"
    assert norm_kind(GemmaRMSNorm(32), 32) == "rmsnorm(1+w)"
    assert norm_kind(torch.nn.RMSNorm(32), 32) == "rmsnorm"
    assert norm_kind(torch.nn.RMSNorm(32, elementwise_affine=False), 32) == "rmsnorm(no weight)"
    assert norm_kind(torch.nn.LayerNorm(32), 32) == "layernorm"
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    assert norm_kind(NemotronLayerNorm1P(32), 32) == "layernorm(1+w)"
    assert norm_kind(torch.nn.GroupNorm(4, 32), 32) == "other"
