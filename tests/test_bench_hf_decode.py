"""The end-to-end benchmark's --tiny mode on CPU: every phase in one process standing for rank 0 of
TP=2 (--fake-world 2: the same graphs, compiles and pass decisions as a real rank, collectives that
compute nothing), and the accuracy phase as CI runs it, torchrun with 2 processes on gloo (real
all-reduces, where the answers are compared).

Timings on a shared 2-core CPU mean nothing; what is checked is that every phase runs, the pass
fuses every site of the model in each graph it compiles (decode, prefill, loop's, generate's own),
the fused model's answers match the unfused one's, and loop and generate report the steady state
per token (by difference of two lengths) and the fixed cost per call apart.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hf_decode.py"
LAYERS = 2
LENGTHS = (12, 4)  # --tiny's default --lengths


def run_tiny(out: Path, *args: str, fake_world: bool = False) -> dict:
    launch = ([sys.executable] if fake_world else
              [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"])
    cmd = [*launch, str(BENCH), "--tiny", "--layers", str(LAYERS), *(("--fake-world", "2") if fake_world else ()),
           *args, "--strict", "--out", str(out), "--ckpt-dir", str(out), "--cache-root", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = out / ("decode_llama_w2_fake2.json" if fake_world else "decode_llama_w2.json")
    return {"json": json.loads(path.read_text()), "path": path, "stdout": done.stdout}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """Every phase, one process (a torchrun pair did the same work twice: about 300 s of CPU, not 135)."""
    return run_tiny(tmp_path_factory.mktemp("bench"), "--batches", "1", "4", "--prefill", "16", "--steps", "8",
                    "--replays", "20", "--quantized", "fp8", fake_world=True)


@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory):
    """The accuracy phase on two gloo ranks: the answers with real all-reduces."""
    return run_tiny(tmp_path_factory.mktemp("bench_torchrun"), "--phases", "accuracy", "--steps", "8")


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_phase_ran(result):
    phases = result["json"]["phases"]
    assert set(phases) == {"startup", "decode", "accuracy", "prefill", "kernels", "loop", "generate"}
    assert not [name for name, p in phases.items() if "error" in p]
    assert phases["kernels"] == {"skipped": "no CUDA: the profiler sees no GPU kernels",
                                 "phase_seconds": phases["kernels"]["phase_seconds"]}
    assert "decode step" in result["stdout"] and "startup to first token" in result["stdout"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_startup_fuses_every_site_cold_and_warm_hits_the_cache(result):
    s = result["json"]["phases"]["startup"]
    assert s["cold_on"]["fused_sites"] == 2 * LAYERS + 1
    assert s["cold_off"]["fused_sites"] == 0
    assert s["cold_on"]["pass_seconds"] > 0
    # Warm: the FX graph cache returns the already rewritten graph; the pass does not run again.
    assert s["warm_on"]["fused_sites"] == 0 and s["warm_on"]["pass_seconds"] == 0
    assert s["warm_on"]["seconds"] < s["cold_on"]["seconds"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_decode_rows_dispatch_the_fused_op_only_when_on(result):
    rows = result["json"]["phases"]["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["on_ms"] > 0 and r["off_ms"] > 0
        assert set(r["on_dispatch"]) == {"torch"} and r["off_dispatch"] == {}


@pytest.mark.multiproc
@pytest.mark.slow
def test_decode_steps_take_the_norm_weight_into_the_op(result):
    """Batch 1 decodes one token: HF Llama's norm is still the `rms` form with its weight in the
    op (it was once left as a multiply after a weightless site, one more kernel per site)."""
    forms = result["json"]["phases"]["decode"]["by_pattern"]
    assert forms and not [name for name in forms if "fp32_weight" in name], forms


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("run", ["torchrun_result", "result"])  # real all-reduces; the fake world's
def test_fused_answers_match_unfused(run, request):
    acc = request.getfixturevalue(run)["json"]["phases"]["accuracy"]
    assert acc["steps"] == 8 and len(acc["on_vs_off_rel_l2"]) == 8
    assert acc["summary"]["on_vs_off_max_rel_l2"] < 2e-2
    # As close to eager as Inductor's own unfused graph is.
    assert acc["summary"]["on_vs_eager_max_rel_l2"] < 2 * acc["summary"]["off_vs_eager_max_rel_l2"] + 1e-3
    assert acc["summary"]["on_vs_off_top1"] >= 0.75  # random weights: near ties may flip
    # Against the same weights run in fp32, no further from the truth than the unfused graph.
    assert len(acc["on_vs_fp32_rel_l2"]) == 8
    assert acc["summary"]["on_vs_fp32_max_rel_l2"] < 2 * acc["summary"]["off_vs_fp32_max_rel_l2"] + 1e-3


@pytest.mark.multiproc
@pytest.mark.slow
def test_generate_and_loop_compile_graphs_the_pass_fuses(result):
    for kind in ("generate", "loop"):
        g = result["json"]["phases"][kind]
        assert g["on"]["fused_sites"] == 2 * LAYERS + 1 and g["off"]["fused_sites"] == 0, kind


def assert_steady_state_by_difference(row: dict, lengths=LENGTHS):
    """ms per token is the median over (long, short) pairs of their difference over the tokens
    between them; the fixed cost per call is what the short call has left at that rate."""
    long_n, short_n = lengths
    assert row["lengths"] == [long_n, short_n] and row["method"] == "difference of two lengths"
    longs, shorts = row["samples_ms"][str(long_n)], row["samples_ms"][str(short_n)]
    assert len(longs) == len(shorts) >= 2
    pairs = [(a - b) / (long_n - short_n) for a, b in zip(longs, shorts)]
    assert row["ms_per_token"] == pytest.approx(statistics.median(pairs), abs=1e-3)
    assert row["fixed_ms"] == pytest.approx(statistics.median(shorts) - short_n * row["ms_per_token"], abs=1e-2)
    # The old method, kept beside it: the whole long call over its tokens.
    assert row["naive_ms_per_token"] == pytest.approx(statistics.median(longs) / long_n, abs=1e-3)
    assert str(long_n) in row["first_call_s"] and row["first_call_s"][str(long_n)] > 0
    assert row["graphs_compiled"] >= 1 and "cudagraph_work" in row


@pytest.mark.multiproc
@pytest.mark.slow
def test_loop_and_generate_report_steady_state_and_fixed_cost_apart(result):
    phases = result["json"]["phases"]
    for kind in ("loop", "generate"):
        assert phases[kind]["lengths"] == list(LENGTHS)
        for name in ("off", "on"):
            assert_steady_state_by_difference(phases[kind][name])
    assert "ms/token steady" in result["stdout"] and "fixed per call" in result["stdout"]


def test_steady_state_separates_the_fixed_cost():
    """A call costing 50 ms plus 10 ms per token: by difference 10 ms/token and 50 ms fixed, where
    the whole call over its tokens says 10.35 (144 tokens) or 13.1 (16)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        from common import per_token_counts, steady_state
    finally:
        sys.path.remove(str(BENCH.parent))
    calls = {144: [50 + 10 * 144 + e for e in (0.0, 0.4, -0.2)], 16: [50 + 10 * 16 + e for e in (0.1, 0.0, 0.3)]}
    s = steady_state(calls)
    assert s["ms_per_token"] == pytest.approx(10, abs=0.01) and s["fixed_ms"] == pytest.approx(50, abs=1)
    assert s["naive_ms_per_token"] == pytest.approx(1490.0 / 144, abs=1e-3)
    counts = per_token_counts(144, {"graph_launches": 143, "kernels": 143 * 300 + 900}, 16,
                              {"graph_launches": 15, "kernels": 15 * 300 + 900})
    assert counts["graph_launches"] == {"per_token": 1.0, "per_call": -1.0}  # the prefill's token is eager
    assert counts["kernels"] == {"per_token": 300.0, "per_call": 600.0}


@pytest.mark.multiproc
@pytest.mark.slow
def test_fake_world_is_one_process_standing_for_rank_zero(result):
    """--fake-world 2: one process holds rank 0's shards (torch's fake process group), compiles and
    fuses every site as a real rank does (the phases' tests above), and says what it stands for."""
    meta = result["json"]["meta"]
    assert meta["fake_world"] == 2 and meta["world"] == 2 and meta["backend"] == "torch"
    assert meta["heads"] == 4 and "fake process group" in meta["fake_world_note"]
    assert meta["command"].startswith("python benchmarks/bench_hf_decode.py")
    assert "TP=2 (fake process group: no communication)" in result["stdout"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_torchrun_runs_on_two_gloo_ranks(torchrun_result):
    meta, phases = torchrun_result["json"]["meta"], torchrun_result["json"]["phases"]
    assert meta["world"] == 2 and not meta.get("fake_world") and set(phases) == {"accuracy"}
    assert "error" not in phases["accuracy"] and "TP=2, cpu" in torchrun_result["stdout"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_plot(result, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    subprocess.run([sys.executable, str(BENCH), "--plot", str(result["path"]), "--png", str(png)], check=True,
                   capture_output=True, timeout=120)
    assert png.stat().st_size > 10_000


@pytest.mark.multiproc
@pytest.mark.slow
def test_prefill_with_the_quantized_all_reduce(result):
    """--quantized fp8: a third prefill config; on CPU the torch backend emulates the quantized
    all-reduce at every size, so every site of the prefill runs it."""
    ran = result
    prefill = ran["json"]["phases"]["prefill"]
    assert prefill["quantized"] == "fp8" and [r["tokens"] for r in prefill["rows"]] == [16]
    r, sites = prefill["rows"][0], 2 * LAYERS + 1
    assert r["off_ms"] > 0 and r["on_ms"] > 0 and r["quantized_ms"] > 0 and r["quantized_vs_on"] > 0
    assert r["off_dispatch"] == {} and r["on_dispatch"] == {"torch": sites}  # per prefill
    assert r["quantized_dispatch"] == {"torch quantized fp8": sites}
    assert r["quantized_calls"] == r["op_calls"] == sites
    assert "calls quantized" in ran["stdout"] and "quantized calls" in ran["stdout"]


def test_rank_of_builds_one_ranks_share_of_the_tp_model():
    """--rank-of N: the TP=N model's per-rank widths as a model of its own (the communication-free
    floor under the TP=N step); head widths and replicated parts unchanged."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_hf_decode as bench
    finally:
        sys.path.remove(str(BENCH.parent))
    llama = bench.one_rank_shape(bench.PRESETS["llama"], 2)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"], llama["intermediate_size"],
            llama["vocab_size"], llama["head_dim"]) == (16, 4, 7168, 64128, 128)
    dsv2 = bench.one_rank_shape(bench.PRESETS["deepseek_v2"], 2)
    assert (dsv2["num_attention_heads"], dsv2["moe_intermediate_size"], dsv2["intermediate_size"]) == (8, 704, 5472)
    assert "head_dim" not in dsv2  # MLA: its head widths are named apart and stay
    assert (dsv2["n_routed_experts"], dsv2["kv_lora_rank"], dsv2["hidden_size"]) == (64, 512, 2048)
    with pytest.raises(SystemExit, match="does not split"):
        bench.one_rank_shape(bench.PRESETS["llama"], 3)
