"""benchmarks/bench_serving.py and its serving_calls.py: serving metrics from per-token timestamps,
which timed calls count (none that captured a CUDA graph or compiled), calls in rounds, and runs on
two gloo ranks and through the fake process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_serving  # noqa: E402
import serving_calls  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))


def test_every_call_gets_new_prompts_the_same_in_every_config():
    # transformers shares KV blocks of a common prefix: a call repeating an earlier one's prompts
    # would skip much of its prefill
    a, b = serving_calls.prompts_for(4, 32, 1000, 1), serving_calls.prompts_for(4, 32, 1000, 2)
    assert a == serving_calls.prompts_for(4, 32, 1000, 1) and len(a) == 4 and len(a[0]) == 32
    assert not {tuple(p) for p in a} & {tuple(p) for p in b}


def test_metrics_from_timestamps():
    out = lambda created, stamps: types.SimpleNamespace(created_time=created, timestamps=stamps,  # noqa: E731
                                                        generated_tokens=[0] * len(stamps))
    m = serving_calls.serving_metrics({"a": out(0.0, [0.1, 0.12, 0.14]), "b": out(0.05, [0.2, 0.23])})
    assert m["ttft_ms"] == pytest.approx(125)  # median of 100 and 150
    assert m["itl_ms"] == pytest.approx(20) and m["itl_p90_ms"] == pytest.approx(30)
    assert m["tokens_per_s"] == pytest.approx(5 / 0.23) and m["new_tokens"] == 5
    assert m["first_tokens_ms"] == [100.0, 200.0]  # from the first admission


def test_calls_that_capture_or_compile_are_excluded_and_counted(monkeypatch):
    """Calls 1 and 3 capture a CUDA graph, call 4 compiles: the steady ones are 0, 2, 5."""
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: None)
    made = []

    def call():
        n = len(made)
        made.append(n)
        if n in (1, 3):
            torch.cuda.CUDAGraph.capture_begin(object())
        if n == 4:
            torch._dynamo.utils.counters["stats"]["unique_graphs"] += 1
        return {"ttft_ms": float(n)}

    steady, excluded = serving_calls.steady_calls(call, 3)
    assert [c["ttft_ms"] for c in steady] == [0.0, 2.0, 5.0]
    assert [(c["ttft_ms"], c["captured"], c["compiled"]) for c in excluded] == [(1.0, 1, 0), (3.0, 1, 0), (4.0, 0, 1)]
    made.clear()
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: None)

    def always_capturing():
        torch.cuda.CUDAGraph.capture_begin(object())
        return {"ttft_ms": 1.0}

    steady, excluded = serving_calls.steady_calls(always_capturing, 2)  # gives up after 2 x repeats
    assert steady == [] and len(excluded) == 4


def test_a_call_another_rank_excluded_is_excluded_here_too():
    """With TP every rank must keep the same calls and make as many: the verdict goes through
    `any_rank` (bench_serving: a MAX all-reduce), so a call steady here but not on a peer is excluded."""
    peers = iter([True, False, False])  # the peer captured a graph in the first call
    verdicts = []

    def any_rank(flag):
        verdicts.append(flag)
        return flag or next(peers)

    steady, excluded = serving_calls.steady_calls(lambda: {"ttft_ms": 1.0}, 2, any_rank)
    assert verdicts == [False, False, False] and len(steady) == 2 and len(excluded) == 1
    kept = serving_calls.interleaved_calls({"off": lambda: {}, "on": lambda: {}}, 1, lambda flag: True)
    assert [len(e) for s, e in kept.values()] == [2, 2] and not any(s for s, e in kept.values())


def test_an_idle_loop_waits_at_most_the_idle_wait(monkeypatch):
    """Every manager made after `shorten_idle_wait(s)` waits at most s for new requests, not 0.1 s;
    a wait without a timeout stays one."""
    import threading
    import time

    from transformers.generation.continuous_batching import continuous_api

    def made(self, *args, **kwargs):  # the manager's own __init__ makes its wake-up event
        self._wake_up_loop = threading.Event()

    monkeypatch.setattr(continuous_api.ContinuousBatchingManager, "__init__", made)
    bench_serving.shorten_idle_wait(0.002)
    manager = continuous_api.ContinuousBatchingManager()
    started = time.perf_counter()
    assert manager._wake_up_loop.wait(timeout=0.1) is False
    assert time.perf_counter() - started < 0.05
    manager._wake_up_loop.set()
    assert manager._wake_up_loop.wait() is True


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("interleave", [False, True], ids=["one_config_then_the_other", "interleaved"])
def test_off_and_on_on_two_gloo_ranks(tmp_path, interleave):
    """Both ways of running the configs with TP ranks: each rank keeps a manager per config, and the
    ranks other than 0 follow rank 0's calls, config by config or alternating."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(ROOT / "benchmarks" / "bench_serving.py"), "--cpu", "--tiny", "--mixes", "1,2",
                           "--repeats", "1", "--prompt", "16", "--new", "4", "--profile-kernels",
                           *(["--interleave"] if interleave else []), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "serving_llama_w2.json").read_text())
    assert result["configs"]["off"]["fused_sites"] == 0 and result["configs"]["on"]["fused_sites"] > 0
    for requests in ("1", "2"):
        row = result["mixes"][requests]
        assert row["tokens"]["ok"] and row["on"]["new_tokens"] == 4 * int(requests)
        assert row["off"]["steady"] and len(row["on"]["calls"]) == 1 and "excluded_calls" in row["on"]
        assert ("pairs" in row) == interleave and all(len(v) == 1 for v in row.get("pairs", {}).values())
        steps = row["on"]["calls"][0]["steps"]  # the prompts' tokens, then a step per further token
        assert sum(steps["varlen"]) >= 16 * int(requests) and steps["decode_fast_path"] + len(steps["varlen"]) >= 4
    for name in ("off", "on"):  # --profile-kernels: where the time went, the generation thread's ops included
        kernels = result["configs"][name]["kernels"]
        assert len(kernels) == 10 and any(k["name"] == "aten::mm" for k in kernels), kernels
        assert 0 < sum(k["share"] for k in kernels) <= 1.0001
        assert "Self CPU" in (tmp_path / f"kernels_{name}_rank0.txt").read_text()


@pytest.mark.parametrize("flag", ["--flashinfer-host-path", "--nccl-host-path"])
def test_host_path_stand_ins_replace_peers_only(flag, monkeypatch, capsys):
    """--flashinfer-host-path and --nccl-host-path replace the peers of a fake world: refused
    without --fake-world."""
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--cpu", flag])
    with pytest.raises(SystemExit) as stop:
        bench_serving.main()
    assert stop.value.code == 2 and "only with --fake-world" in capsys.readouterr().err


@pytest.mark.slow
def test_fake_world_with_nccl_host_path_serves_off_and_on(tmp_path):
    """--fake-world 2 --nccl-host-path: one process, the all-reduces on a real one-rank group (gloo
    here), counted in the JSON; both configs serve and give the same tokens."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--cpu", "--tiny",
                           "--fake-world", "2", "--nccl-host-path", "--mixes", "2", "--repeats", "1", "--prompt", "16",
                           "--new", "4", "--log-info", "--interleave", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "serving_llama_w2_fake.json").read_text())
    assert result["meta"]["nccl_host_path"] and result["meta"]["all_reduces_on_one_rank"] > 0
    assert result["configs"]["on"]["fused_sites"] > 0 and result["mixes"]["2"]["tokens"]["ok"]
    assert result["configs"]["on"]["eager_in_cuda_graphs"] == {}
    assert "[arfusion] arfusion: fused" in done.stderr  # --log-info: what the pass did, as it says it
    row = result["mixes"]["2"]  # --interleave: a model per config, calls in rounds, on / off per round
    assert [c["round"] for c in row["off"]["calls"] + row["on"]["calls"]] == [0, 0]
    assert row["pairs"]["itl_ms"] == [pytest.approx(row["on"]["itl_ms"] / row["off"]["itl_ms"], rel=1e-3)]
    assert result["configs"]["off"]["fused_sites"] == 0


def test_interleaved_calls_alternate_and_pair_by_round(monkeypatch):
    """Rounds run A B, B A, A B ...; a call that captured a CUDA graph is kept apart and its round
    gets no ratio; rounds stop once each config has its steady calls."""
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: None)
    order = []

    def call(name, value):
        def made():
            order.append(name)
            if name == "on" and order.count("on") == 1:  # its first call captures
                torch.cuda.CUDAGraph.capture_begin(object())
            return {"itl_ms": value}
        return made

    kept = serving_calls.interleaved_calls({"off": call("off", 10.0), "on": call("on", 8.0)}, 2)
    assert order == ["off", "on", "on", "off", "off", "on"]
    (off, off_excluded), (on, on_excluded) = kept["off"], kept["on"]
    assert [c["round"] for c in off] == [0, 1, 2] and off_excluded == []  # a round is whole
    assert [c["round"] for c in on] == [1, 2] and [c["round"] for c in on_excluded] == [0]
    assert serving_calls.pair_ratios(on, off, "itl_ms") == [0.8, 0.8]  # round 0 has no steady "on"


def test_stats_of_calls_add_up():
    a = {"fused_sites": 4, "dispatch": {"fused": 3}, "graphs": 2, "note": "x"}
    b = {"fused_sites": 0, "dispatch": {"fused": 1, "fallback": 2}, "graphs": 1}
    assert serving_calls.add_stats(serving_calls.add_stats({}, a), b) == {
        "fused_sites": 4, "dispatch": {"fused": 4, "fallback": 2}, "graphs": 3}


def test_host_use_sees_a_busy_neighbour_and_page_faults():
    """HostUse over a span: another thread spinning shows as other threads' CPU time (and as the
    busiest one), touching fresh memory as this thread's minor page faults, and this thread's own
    CPU time stays below the wall time it slept through."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from serving_probes import HostUse
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    neighbour = threading.Thread(target=spin)
    neighbour.start()
    try:
        use = HostUse()
        touched = bytearray(64 << 20)  # 64 MiB of fresh pages, each written once
        touched[::4096] = b"\1" * len(touched[::4096])
        time.sleep(0.6)
        seen = use.since()
    finally:
        stop.set()
        neighbour.join()
    assert seen["other_threads_cpu_ms"] > 100 and seen["busiest_other_thread"][1] >= 100
    assert seen["minor_faults"] >= 16  # 16,384 small pages, or 32 where transparent huge pages back them
    assert 0 < seen["main_cpu_share"] < 0.9 and seen["main_cpu_ms"] > 0
    assert len(seen["cpus"]) == 2 and all(c is None or c >= 0 for c in seen["cpus"])
