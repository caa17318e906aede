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

import contextlib
import gc
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hf_decode.py"
LAYERS = 2
LENGTHS = (12, 4)  # --tiny's default --lengths
PAIRS = 3


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
                    "--replays", "20", "--quantized", "fp8", "--floor", "--pairs", str(PAIRS),
                    "--gen-variants", "greedy:1", "sample:1", fake_world=True)


@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory):
    """The accuracy phase on two gloo ranks: the answers with real all-reduces."""
    return run_tiny(tmp_path_factory.mktemp("bench_torchrun"), "--phases", "accuracy", "--steps", "8",
                    "--budget-s", "10000")  # the budget's check is a broadcast from rank 0: run it on real ranks


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
def test_decode_floor_drops_every_all_reduce(result):
    """--floor: a third decode config compiled with every all-reduce dropped (the step's lower
    bound); each row says what share of the all-reduces' time (off - floor) the pass removes."""
    decode = result["json"]["phases"]["decode"]
    # One graph for batch 1, one dynamic-batch graph for the rest: every all-reduce of each.
    assert decode["floor"]["all_reduces_dropped"] == 2 * (2 * LAYERS + 1)
    for r in decode["rows"]:
        assert r["floor_ms"] > 0 and r["floor_dispatch"] == {}
        assert r["comm_ms"] == pytest.approx(r["off_ms"] - r["floor_ms"], abs=1e-3)
        if r["comm_ms"] > 0:
            assert r["comm_removed_pct"] == pytest.approx(100 * (r["off_ms"] - r["on_ms"]) / r["comm_ms"], abs=0.1)
    assert "floor ms" in result["stdout"] and "comm removed" in result["stdout"]


def test_floor_pass_replaces_each_all_reduce_by_its_input():
    """The floor's graph pass on a traced graph: all_reduce + wait_tensor gone, their reader
    reading the all-reduce's input; an all-gather stays."""
    import torch
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(BENCH.parent))
    try:
        from common import NoAllReduce, floor_options
    finally:
        sys.path.remove(str(BENCH.parent))
    c10d = torch.ops._c10d_functional

    def f(x):
        y = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0"))
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(y + 1, 2, "0"))
        return g.sum()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        graph = make_fx(f)(torch.randn(4)).graph  # the ops' default overloads, as post-grad graphs hold
        before = NoAllReduce.dropped
        floor_options()["post_grad_custom_post_pass"](graph)
        targets = [n.target for n in graph.nodes if n.op == "call_function"]
        assert NoAllReduce.dropped == before + 1
        assert c10d.all_reduce.default not in targets and targets.count(c10d.wait_tensor.default) == 1
        assert c10d.all_gather_into_tensor.default in targets
        add = next(n for n in graph.nodes if n.op == "call_function" and "add" in str(n.target))
        assert "mul" in str(add.args[0].target)  # y + 1 now reads x * 2
    finally:
        dist.destroy_process_group()


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


VARIANTS = {"generate": ["greedy_b1", "sample_b1"], "loop": ["greedy_b1"]}  # the loop is greedy only


@pytest.mark.multiproc
@pytest.mark.slow
def test_generate_and_loop_compile_graphs_the_pass_fuses(result):
    for kind, labels in VARIANTS.items():
        g = result["json"]["phases"][kind]
        assert list(g["variants"]) == labels, kind
        for label in labels:
            v = g["variants"][label]
            # The first variant compiles; sampling at the same batch reuses its graphs.
            compiled = 2 * LAYERS + 1 if label == "greedy_b1" else 0
            assert v["on"]["fused_sites"] == compiled and v["off"]["fused_sites"] == 0, (kind, label)
            # Every call of "on" runs the fused op (torch backend here), none of "off".
            assert set(v["on"]["dispatch"]) == {"torch"} and v["on"]["dispatch"]["torch"] > 0, (kind, label)
            assert v["off"]["dispatch"] == {}, (kind, label)
            assert v["batch"] == 1 and v["sample"] == (label == "sample_b1")


def assert_interleaved_pairs(v: dict, lengths=LENGTHS):
    """Each pair holds one call of each config at each length, the config going first alternating;
    a config's ms per token in a pair is the difference of its two calls over the tokens between
    them, its row the median over valid pairs; the ratio is per pair, then its median."""
    long_n, short_n = lengths
    pairs = v["pairs"]
    assert len(pairs) >= PAIRS and v["valid_pairs"] + v["excluded_pairs"] == len(pairs)
    assert [p["order"] for p in pairs[:2]] == [["off", "on"], ["on", "off"]]
    valid = [p for p in pairs if p["valid"]]
    assert len(valid) == v["valid_pairs"] >= PAIRS  # CPU: no CUDA graphs, nothing recompiles after the first calls
    for name in ("off", "on"):
        for p in pairs:
            c = p[name]
            assert c["ms_per_token"] == pytest.approx((c["long_ms"] - c["short_ms"]) / (long_n - short_n), abs=1e-3)
            assert c["fixed_ms"] == pytest.approx(c["short_ms"] - short_n * c["ms_per_token"], abs=1e-2)
        row = v[name]
        assert row["ms_per_token"] == pytest.approx(statistics.median(p[name]["ms_per_token"] for p in valid), abs=1e-3)
        assert row["ms_per_token_spread"]["n"] == len(valid)
        assert row["naive_ms_per_token"] == pytest.approx(
            statistics.median(p[name]["long_ms"] for p in valid) / long_n, abs=1e-3)
        assert str(long_n) in row["first_call_s"] and str(short_n) in row["first_call_s"]
    for p in pairs:
        speedup = p["off"]["ms_per_token"] / p["on"]["ms_per_token"]
        assert p["on_speedup"] == pytest.approx(speedup, rel=1e-3, abs=5e-5)  # rounded to 4 places
    assert v["on_speedup"]["median"] == pytest.approx(statistics.median(p["on_speedup"] for p in valid), abs=1e-3)


@pytest.mark.multiproc
@pytest.mark.slow
def test_loop_and_generate_time_interleaved_pairs_by_difference(result):
    phases = result["json"]["phases"]
    for kind, labels in VARIANTS.items():
        assert phases[kind]["lengths"] == list(LENGTHS) and phases[kind]["method"].startswith("interleaved pairs")
        for label in labels:
            assert_interleaved_pairs(phases[kind]["variants"][label])
    assert "ms/token" in result["stdout"] and "valid pairs" in result["stdout"]


def test_excluded_pairs_and_spread():
    """A pair where a call recompiled or re-recorded a CUDA graph is left out of the medians and
    counted with what happened; the spread is the valid pairs' median, quartiles and extremes."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import decode_host
        from common import by_difference, per_token_counts
    finally:
        sys.path.remove(str(BENCH.parent))
    per_token, fixed = by_difference(144, 50 + 10 * 144, 16, 50 + 10 * 16)
    assert per_token == pytest.approx(10) and fixed == pytest.approx(50)
    counts = per_token_counts(144, {"graph_launches": 143, "kernels": 143 * 300 + 900}, 16,
                              {"graph_launches": 15, "kernels": 15 * 300 + 900})
    assert counts["graph_launches"] == {"per_token": 1.0, "per_call": -1.0}  # the prefill's token is eager
    assert counts["kernels"] == {"per_token": 300.0, "per_call": 600.0}
    assert decode_host.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "q1": 1.25, "q3": 8.25, "min": 1.0,
                                                           "max": 10.0, "n": 4}
    assert decode_host.parse_variant("sample:8") == ("sample_b8", True, 8)
    assert decode_host.parse_variant("greedy_b8") == ("greedy_b8", False, 8)  # matrix.py specs cannot hold ":"
    with pytest.raises(ValueError):
        decode_host.parse_variant("beam:2")

    # Two configs costing 50 ms a call plus 10 (off) or 8 (on) ms a token; the on config's call
    # number 3 (its first pair's short call, after its two first calls) re-records a CUDA graph.
    runners = {name: decode_host.Runner(None, name) for name in ("off", "on")}
    made, redo = {"off": 0, "on": 0}, {"on": {3}}
    redone = []

    def call_for(name, rate):
        def call(n):
            redone.append(made[name] in redo.get(name, ()))
            made[name] += 1
            if name == "off" and n == 144:
                gc.collect()  # a full collection inside each of off's long calls: counted, its time apart
            return 50 + rate * n
        return call

    @contextlib.contextmanager
    def work(tally):
        yield tally
        if redone.pop():
            tally["record_function"] = 1

    import torch

    b = types.SimpleNamespace(args=types.SimpleNamespace(lengths=[144, 16], pairs=3), cuda=False,
                              device=torch.device("cpu"))
    callbacks = list(gc.callbacks)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_host, "wall_ms", lambda fn, device=None: fn())
        mp.setattr(decode_host, "cudagraph_tree_work", work)
        mp.setattr(decode_host.dist, "barrier", lambda: None)
        out = decode_host.measure_variant(b, runners, {"off": call_for("off", 10), "on": call_for("on", 8)},
                                          types.SimpleNamespace(update=lambda *_: None))
    assert gc.callbacks == callbacks  # the gc recorder left with the measurement
    assert out["excluded_pairs"] == 1 and out["valid_pairs"] == 3 and len(out["pairs"]) == 4
    assert out["excluded_why"] == {"on: CUDA graphs recorded again or eager warm-up": 1}
    assert not out["pairs"][0]["valid"] and all(p["valid"] for p in out["pairs"][1:])
    assert out["off"]["ms_per_token"] == pytest.approx(10) and out["on"]["ms_per_token"] == pytest.approx(8)
    assert out["on_speedup"]["median"] == pytest.approx(1.25) and out["on_speedup"]["n"] == 3
    assert out["off"]["fixed_ms"] == pytest.approx(50)
    for p in out["pairs"]:
        assert p["off"]["gc_full"] >= 1 and p["off"]["gc_ms"] > 0
        assert p["off"]["ms_per_token_without_gc"] < p["off"]["ms_per_token"]
        assert p["on"]["ms_per_token_without_gc"] == pytest.approx(p["on"]["ms_per_token"], abs=0.01)
        for name in ("off", "on"):  # what the host did in the long call, and the probe right after it
            assert p[name]["host"]["main_cpu_ms"] >= 0 and p[name]["host"]["minor_faults"] >= 0
            assert set(p[name]["probe_us"]) == {"empty", "view"} and min(p[name]["probe_us"].values()) > 0
    assert out["off"]["probe_view_us"] > 0 and len(out["on"]["first_call_cpus"]) == 4


def test_profiles_run_after_every_variants_pairs_are_saved():
    """On GPU the profiler runs once every variant's pairs are measured and saved, within the budget:
    a profiled call that never returns (a TP=4 generate() on 4xH100, 2026-11-27) costs the profile
    only. A failed variant is not profiled."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import decode_host
    finally:
        sys.path.remove(str(BENCH.parent))
    import time

    events = []

    class Runner:
        def __init__(self, b, name):
            pass

        def variant(self, sample, batch):
            if batch == 4:
                raise RuntimeError("boom")
            return {}

    def measure(b, runners, calls, progress):
        events.append("measure")
        config = lambda ms: {"ms_per_token": ms, "ms_per_token_spread": {"min": ms, "max": ms}, "fixed_ms": 5.0,  # noqa: E731
                             "fused_sites": 0}
        return {"off": config(2.0), "on": config(1.0), "valid_pairs": 2, "excluded_pairs": 0, "excluded_why": {}}

    b = types.SimpleNamespace(args=types.SimpleNamespace(configs=["off", "on"], gen_variants=["greedy:1", "greedy:4", "sample:8"],
                                                         generate_mode="reduce-overhead", pairs=2, lengths=[32, 8], prompt=16, budget_s=1000, strict=False),
                              cuda=True, rank=1, model=None, compiled={}, result={"phases": {}}, started=time.time(),
                              save=lambda: events.append("save"), say=lambda *_: None,
                              out_of_time=lambda needed_s=0.0: False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(decode_host.RUNNERS, "generate", Runner)
        mp.setattr(decode_host, "forget_compiles", lambda model: None)
        mp.setattr(decode_host, "measure_variant", measure)
        mp.setattr(decode_host, "profile_variant", lambda b, runners, calls, row, progress: events.append("profile"))
        result = decode_host.run_host_phase(b, "generate")
    assert events == ["measure", "save", "save", "measure", "save", "profile", "save", "profile", "save"]
    assert "error" in result["variants"]["greedy_b4"] and result["variants"]["sample_b8"]["on"]["ms_per_token"] == 1.0


def import_bench(name: str):
    sys.path.insert(0, str(BENCH.parent))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH.parent))


@pytest.mark.parametrize("budget, rows, skipped", [(30, [1], [8, 32]), (50, [1, 8, 32], None)])
def test_decode_skips_a_batch_whose_compiles_would_pass_the_budget(budget, rows, skipped):
    """A decode batch that compiles a graph (batch 1: the static one; the first batch > 1: the
    dynamic one) starts only if a batch as long as the longest so far ends within --budget-s; one
    that replays a compiled graph always runs. On 2xH200 (2026-11-28) a 27-layer DeepSeek-V2-Lite
    step began batch 8 at 256 s of a 374 s budget and its compiles were cut by the call's limit."""
    import torch

    decode_phases = import_bench("decode_phases")
    clock, asked = [0.0], []

    def time_step(step, reset):
        clock[0] += 10.0  # each config's compile and timed replays
        return 1.0

    def out_of_time(needed_s=0.0):
        asked.append(needed_s)
        return clock[0] + needed_s > budget

    b = types.SimpleNamespace(
        args=types.SimpleNamespace(floor=False, batches=[1, 8, 32], replays=3, prompt=4),
        compiled_model=lambda name: None,
        prefilled=lambda batch: (types.SimpleNamespace(layers=[]), torch.zeros(batch, 1)),
        time_step=time_step, rewinder=lambda cache, n: None, say=lambda *_: None, result={"phases": {}},
        save=lambda: None, cuda=False, out_of_time=out_of_time)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_phases, "time", types.SimpleNamespace(time=lambda: clock[0]))
        out = decode_phases.phase_decode(b)
    assert [r["batch"] for r in out["rows"]] == rows
    assert out.get("skipped_batches", {}).get("batches") == skipped
    # Run: batch 32 replays batch 8's graph, never asked (at 40 s, 20 more would pass 50). Skipped:
    # batch 32 would compile the dynamic graph itself, asked again.
    assert asked == ([0.0, 20.0, 20.0] if skipped else [0.0, 20.0])


def test_decode_keeps_the_configs_it_timed_when_a_later_one_fails():
    """A decode batch saves each config as it is timed, and a failing phase keeps what it saved: on
    2xH200 (2026-11-28) a 70B-shape batch 8 at 80 layers was killed in its compiles with nothing
    written, although its first configs may have been timed."""
    import torch

    decode_phases = import_bench("decode_phases")
    bench = import_bench("bench_hf_decode")
    saved = []

    def time_step(step, reset):
        if time_step.calls == 2:  # off, on, then the floor fails
            raise RuntimeError("floor compile failed")
        time_step.calls += 1
        return 2.0 if time_step.calls == 1 else 1.5
    time_step.calls = 0

    b = types.SimpleNamespace(
        args=types.SimpleNamespace(floor=True, batches=[8], replays=3, prompt=4, phases=["decode"], strict=False),
        compiled_model=lambda name: None,
        prefilled=lambda batch: (types.SimpleNamespace(layers=[]), torch.zeros(batch, 1)),
        time_step=time_step, rewinder=lambda cache, n: None, say=lambda *_: None, result={"phases": {}},
        cuda=False, out_of_time=lambda needed_s=0.0: False)
    b.save = lambda: saved.append(json.loads(json.dumps(b.result["phases"].get("decode", {}))))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench.PHASES, "decode", decode_phases.phase_decode)
        bench.run_phases(b)
    decode = b.result["phases"]["decode"]
    assert "floor compile failed" in decode["error"] and decode["partial"]
    assert decode["rows"] == [] and decode["incomplete_row"]["off_ms"] == 2.0 and decode["incomplete_row"]["on_ms"] == 1.5
    assert [sorted(k for k in s["incomplete_row"] if k.endswith("_ms")) for s in saved[:2]] == [["off_ms"], ["off_ms", "on_ms"]]


def test_prefill_keeps_the_lengths_it_timed_when_a_later_one_fails():
    """4xH200 (2026-11-28): a prefill stage cut by its call's limit left nothing; each length is now
    saved as it is timed."""
    import torch

    decode_phases = import_bench("decode_phases")
    bench = import_bench("bench_hf_decode")

    def time_step(step, reset, warmup=2):
        time_step.calls += 1
        if time_step.calls > 2:  # 512 tokens off and on, then 2048 fails
            raise RuntimeError("killed")
        return 4.0 if time_step.calls == 1 else 3.0
    time_step.calls = 0
    model = lambda **kw: types.SimpleNamespace(logits=torch.zeros(1))
    b = types.SimpleNamespace(
        args=types.SimpleNamespace(prefill=[512, 2048], quantized=None, phases=["prefill"], strict=False),
        compile=lambda name: model, prompt=lambda batch, length, seed: torch.zeros(batch, length, dtype=torch.long),
        time_step=time_step, say=lambda *_: None, result={"phases": {}}, save=lambda: None,
        out_of_time=lambda needed_s=0.0: False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench.PHASES, "prefill", decode_phases.phase_prefill)
        bench.run_phases(b)
    prefill = b.result["phases"]["prefill"]
    assert "killed" in prefill["error"] and prefill["partial"]
    assert [(r["tokens"], r["off_ms"], r["on_ms"]) for r in prefill["rows"]] == [(512, 4.0, 3.0)]


def test_rank_zero_decides_the_budget_for_every_rank():
    """Ranks asking near the limit must not part ways: a late rank 1 follows rank 0's answer."""
    import time

    import torch

    decode_model = import_bench("decode_model")
    late = types.SimpleNamespace(args=types.SimpleNamespace(budget_s=10.0), started=time.time() - 60,
                                 device=torch.device("cpu"))
    sent = []

    def broadcast(t, src):  # rank 0, on time, sends 0
        sent.append(float(t.item()))
        t.fill_(0.0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_model.dist, "broadcast", broadcast)
        assert decode_model.Bench.out_of_time(late) is False
    assert sent == [1.0]  # rank 1 alone would have stopped
    assert decode_model.Bench.out_of_time(types.SimpleNamespace(args=types.SimpleNamespace(budget_s=0))) is False


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


def test_llama_70b_preset_is_a_llama_of_that_shape():
    """--model-type llama70b: Llama-3-70B's widths as a Llama config, --layers of its 80."""
    import types

    sys.path.insert(0, str(BENCH.parent))
    try:
        import decode_model
    finally:
        sys.path.remove(str(BENCH.parent))
    args = types.SimpleNamespace(tiny=False, model_type="llama70b", layers=20, rank_of=1)
    c = decode_model.model_config(args, 4)
    assert c.model_type == "llama" and c.num_hidden_layers == 20
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (8192, 64, 8, 28672)
    assert decode_model.PRESETS["llama70b"]["num_hidden_layers"] == 80


def test_repeated_layers_compute_the_deep_model_they_stand_for():
    """--unique-layers: a 2-layer model made 6 deep by reusing its layers (decode_model.repeat_layers)
    decodes as a 6-layer model whose layer i holds layer i % 2's weights, the KV cache included:
    each copy reads and writes its own cache layer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(BENCH.parent))
    from decode_model import repeat_layers

    def config(layers):
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=layers, vocab_size=128, max_position_embeddings=64)

    torch.manual_seed(0)
    short = AutoModelForCausalLM.from_config(config(2)).eval()
    deep = AutoModelForCausalLM.from_config(config(6)).eval()
    with torch.no_grad():
        for name, param in deep.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                parts[2] = str(int(parts[2]) % 2)
            param.copy_(short.get_parameter(".".join(parts)))
    repeat_layers(short, 6)
    assert len(short.model.layers) == 6 and short.config.num_hidden_layers == 6
    assert short.model.layers[4].self_attn.layer_idx == 4 and short.model.layers[0].self_attn.layer_idx == 0
    assert short.model.layers[4].self_attn.q_proj.weight is short.model.layers[0].self_attn.q_proj.weight
    prompt = torch.tensor([[5, 9, 17, 3]])
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  cache_implementation="static", pad_token_id=0)
    got, want = short.generate(prompt, **kwargs), deep.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b)


def test_flashinfer_host_path_runs_everything_but_the_kernel(fake_pg, monkeypatch):
    """--flashinfer-host-path: in one process standing for rank 0 (no peers), the fused op takes
    FlashInfer's whole host path on a stand-in workspace and stops short of the kernel."""
    from dataclasses import replace

    import arfusion
    import arfusion.ops  # noqa: F401  (registers torch.ops.arfusion.*)
    import torch
    from arfusion import runtime
    from arfusion.backends import flashinfer as fi, flashinfer_kernel, get_backend
    from arfusion.backends.base import tables_changed

    from .fake_flashinfer import H200, install_fake_flashinfer, remove_fake_flashinfer

    calls = install_fake_flashinfer()
    backend = get_backend("flashinfer")
    for owner, name in ((fi.FlashInferBackend, "_new_workspace"), (flashinfer_kernel, "kernel_call"),
                        (backend, "unavailable"), (backend, "capabilities")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # put back after the test
    monkeypatch.setattr(fi, "device_facts", lambda index: H200)
    monkeypatch.setattr(runtime, "device_index", lambda device: 0)
    backend.capabilities = replace(backend.capabilities, device_types=frozenset({"cpu"}))
    backend.unavailable = lambda device: None
    sys.path.insert(0, str(BENCH.parent))
    try:
        from common import flashinfer_host_path_only

        flashinfer_host_path_only()
        tables_changed()
        arfusion.reset_stats()
        x, residual = torch.randn(2, 1, 3, 64, dtype=torch.bfloat16).unbind(0)
        outs = torch.ops.arfusion.fused_allreduce_rmsnorm(
            x=x, residual=residual, weight=torch.ones(64, dtype=torch.bfloat16), eps=1e-6, eps_tensor=None,
            group_name=fake_pg.group_name, norm="rms", quant="none", quant_scale=None, emit_norm=True,
            backend="flashinfer")
    finally:
        sys.path.remove(str(BENCH.parent))
        remove_fake_flashinfer()
        tables_changed()
        backend._groups.pop(fake_pg.group_name, None)  # the stand-in workspace goes with the test
    assert arfusion.stats()["dispatch"] == {"flashinfer": 1}
    assert [tuple(o.shape) for o in outs] == [(1, 3, 64), (1, 3, 64)]
    assert calls["create"] == [] and calls["fusion"] == [] and calls["direct"] == 0  # no workspace, no kernel


def test_pin_numa_moves_the_process_to_its_gpus_node(tmp_path, monkeypatch):
    """--pin-numa: the CPUs of the GPU's NUMA node (sysfs), before anything loads; one node or an
    unknown GPU node: left as it is. The placement goes into the JSON's meta either way."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH.parent))
    for node, cpus in (("node0", "0-1"), ("node1", "2-3,6")):
        (tmp_path / "devices/system/node" / node).mkdir(parents=True)
        (tmp_path / "devices/system/node" / node / "cpulist").write_text(cpus + "\n")
    pinned = []
    monkeypatch.setattr(common.os, "sched_setaffinity", lambda pid, cpus: pinned.append(list(cpus)))
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(common, "gpu_numa_node", lambda index, sysfs: 1)
    assert common.numa_placement(0, pin=True, sysfs=str(tmp_path)) == {
        "nodes": {"0": 2, "1": 3}, "gpu_node": 1, "pinned": True, "cpus": 4}
    assert pinned == [[2, 3, 6]]
    assert not common.numa_placement(0, pin=False, sysfs=str(tmp_path))["pinned"] and len(pinned) == 1
    monkeypatch.setattr(common, "gpu_numa_node", lambda index, sysfs: None)
    assert not common.numa_placement(0, pin=True, sysfs=str(tmp_path))["pinned"] and len(pinned) == 1


@pytest.mark.multiproc
def test_nccl_host_path_puts_every_all_reduce_on_a_real_group_of_one(tmp_path):
    """--fake-world 2 --nccl-host-path: rank 0's shards on the fake group, but each all-reduce runs
    on a real one-rank group (gloo here, NCCL on a GPU), so "off" pays a real rank's host path;
    the TP plan's other collectives (the lm_head's all-gather) stay fake; both configs run."""
    got = run_tiny(tmp_path, "--nccl-host-path", "--phases", "generate", "--generate-mode", "default",
                   "--pairs", "2", "--lengths", "8", "4", "--gen-variants", "greedy:1", fake_world=True)
    meta, row = got["json"]["meta"], got["json"]["phases"]["generate"]["variants"]["greedy_b1"]
    # off's alone: two a layer a token, in its first calls and in two pairs (on's torch backend adds its own)
    assert meta["all_reduces_on_one_rank"] >= 2 * LAYERS * (8 + 4) * 3
    assert "group of one rank" in meta["fake_world_note"]
    assert row["valid_pairs"] == 2 and row["on"]["fused_sites"] == 2 * LAYERS + 1
    assert row["off"]["ms_per_token"] > 0 and row["on"]["ms_per_token"] > 0


def test_nccl_host_path_only_with_a_fake_world():
    done = subprocess.run([sys.executable, str(BENCH), "--nccl-host-path", "--tiny"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "only with --fake-world" in done.stderr


def test_plot_of_host_runs_shows_each_pair(tmp_path):
    """--plot on loop / generate results (no decode rows): each variant's pairs, labelled with what
    off's all-reduce ran on (the fake group, or NCCL on one rank with --nccl-host-path)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import decode_report
    finally:
        sys.path.remove(str(BENCH.parent))
    pairs = [{"valid": True, "on_speedup": r} for r in (0.9, 1.1, 1.2)] + [{"valid": False, "on_speedup": 0.1}]
    run = {"meta": {"model_type": "qwen3_moe", "layers": 24, "fake_world": 2, "all_reduces_on_one_rank": 10,
                    "device": "NVIDIA H200", "date": "2026-11-29 11:45"},
           "phases": {"generate": {"variants": {"greedy_b1": {"pairs": pairs, "on_speedup": {"median": 1.1}}}}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert decode_report.pair_rows(run) == [
        ("qwen3_moe 24L generate greedy_b1, off's all-reduce: NCCL on one rank", [0.9, 1.1, 1.2], 1.1)]
    decode_report.plot([str(path)], str(tmp_path / "pairs.png"))
    assert (tmp_path / "pairs.png").stat().st_size > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {}, "phases": {}}))
    with pytest.raises(SystemExit, match="no decode rows or pairs"):
        decode_report.plot([str(empty)], str(tmp_path / "x.png"))
