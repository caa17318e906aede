"""benchmarks/matrix.py: the stages it knows, how a run spreads them over GPUs, and its report
(one row per measurement, the 0.98 bar, a table and a plot per machine) from result files;
benchmarks/matrix_goals.py: the issue's goals against those rows."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import matrix  # noqa: E402
import matrix_goals  # noqa: E402

sys.path.remove(str(BENCH))


def test_stage_specs_and_commands():
    name, gpus, env, args = matrix.parse_spec("generate2@2,3:TRANSFORMERS_WHEEL=w.whl:X=1")
    assert (name, gpus, env, args) == ("generate2", [2, 3], {"TRANSFORMERS_WHEEL": "w.whl", "X": "1"}, [])
    # Extra arguments come after the stage's own, so they win; two runs of one stage write apart.
    name, gpus, env, args = matrix.parse_spec("decode2@0,1:--batches=8 32:X=1")
    assert (env, args) == ({"X": "1"}, ["--batches", "8", "32"])
    assert matrix.parse_spec("serve2:--profile-kernels:--repeats=4")[3] == ["--profile-kernels", "--repeats", "4"]
    assert matrix.parse_spec("serve2:--profile-kernels=")[3] == ["--profile-kernels"]  # the older spelling
    cmd = matrix.stage_command(name, Path("/o"), 0, 400, args)
    assert cmd[-5:] == ["--batches", "8", "32", "--out", "/o"] and cmd.index("--floor") < cmd.index("8")
    assert matrix.stage_folder("serve2", ["--configs", "off"]) == "serve2_configs_off"
    assert matrix.stage_folder("serve2", []) == "serve2"
    assert matrix.stage_folder("moe2", [], {"ARFUSION_FLASHINFER_MOE_FINALIZE": "1"}) == "moe2_ARFUSIONFLASHINFERMOEFINALIZE1"
    assert matrix.stage_folder("generate2", [], {"TRANSFORMERS_WHEEL": ".whl/transformers-5.24.0-py3-none-any.whl"}) \
        == "generate2_TRANSFORMERSWHEELtransformers5.24.0py3noneany"
    with pytest.raises(SystemExit, match="takes 4 GPUs"):
        matrix.parse_spec("decode4@0,1")
    with pytest.raises(SystemExit, match="unknown stage"):
        matrix.parse_spec("nothing2")
    with pytest.raises(SystemExit, match="is not VAR=VALUE"):  # a value holding ":" (it separates parts)
        matrix.parse_spec("generate4:--gen-variants=greedy:1")
    cmd = matrix.stage_command("decode2", Path("/o"), 1, 400)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--master-port") + 1] == "29511"
    assert "--floor" in cmd and cmd[cmd.index("--ckpt-dir") + 1] == "/tmp/arfusion-matrix-ckpt1"
    assert cmd[cmd.index("--budget-s") + 1] == "310" and cmd[-2:] == ["--out", "/o"]
    assert "--ckpt-dir" not in matrix.stage_command("site2", Path("/o"), 0, 200)
    env = matrix.stage_env([2, 3], {})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert "decode2" in matrix.plan() and "generate4" in matrix.plan()
    cmd = matrix.stage_command("generatesample4", Path("/o"), 0, 540)
    assert cmd[cmd.index("--gen-variants") + 1:cmd.index("--gen-variants") + 4] == ["sample:1", "sample:8", "--tag"]
    cmd = matrix.stage_command("generate4_70b", Path("/o"), 0, 560)  # its one variant, given once
    assert cmd.count("--gen-variants") == 1 and cmd[cmd.index("--gen-variants") + 1:][:2] == ["greedy:1", "--tag"]


def test_lanes_run_side_by_side_and_their_stages_in_turn(tmp_path, monkeypatch):
    lanes = matrix.parse_group("decode2@0,1+quantized2@2,3>moe2@2,3:X=1")
    assert [[spec[0] for spec in lane] for lane in lanes] == [["decode2"], ["quantized2", "moe2"]]
    assert lanes[1][1][1:3] == ([2, 3], {"X": "1"})
    with pytest.raises(SystemExit, match="unknown stage"):  # every spec is read before anything starts
        matrix.run(["decode2", "site2>nothing2"], tmp_path, 100)
    seen = []

    def fake_stage(spec, slot, out, end):
        seen.append((spec[0], slot, "start"))
        time.sleep(0.2 if spec[0] == "decode2" else 0.05)
        seen.append((spec[0], slot, "end"))
        return int(spec[0] == "moe2")

    monkeypatch.setattr(matrix, "run_stage", fake_stage)
    assert matrix.run(["decode2@0,1+quantized2@2,3>moe2@2,3", "site2"], tmp_path, 100) == 1
    # Lane 1's two stages (slot 1, one after the other) ran while lane 0's one stage did; the next group after both.
    assert seen.index(("quantized2", 1, "end")) < seen.index(("moe2", 1, "start")) < seen.index(("decode2", 0, "end"))
    assert seen[-2:] == [("site2", 0, "start"), ("site2", 0, "end")]


def write(folder: Path, name: str, obj: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(obj))


META = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-27 22:00", "torch": "2.11.0", "transformers": "5.24.0",
        "model_type": "llama", "layers": 32, "hidden": 4096, "world": 2}


def test_report_rows_bar_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    write(tmp_path / "site2", "bench_w2.json", {"meta": {**META}, "rows": [
        {"world": 2, "hidden": 4096, "tokens": 1, "a0_us": 10.0, "b_us": 5.0, "b_path": "fused one-shot"},
        {"world": 2, "hidden": 4096, "tokens": 8192, "a0_us": 300.0, "b_us": 330.0, "ur_us": 330.0, "br_us": 329.0,
         "b_path": "unfused"}]})
    write(tmp_path / "qop2", "bench_quantized_w2.json", {"meta": {**META, "level": "fp8"}, "rows": [
        {"world": 2, "hidden": 4096, "mib": 8, "tokens": 1024, "a0_us": 60.0, "b_us": 40.0, "b_vs_exact": 1.2,
         "b_dispatch": {"flashinfer quantized fp8": 104}},
        {"world": 2, "hidden": 4096, "mib": 16, "tokens": 2048, "a0_us": 116.0, "b_us": 128.0, "b_vs_exact": 0.9,
         "b_dispatch": {}}]})
    write(tmp_path / "sitequant2", "bench_quant_w2.json", {"meta": {**META}, "rows": [  # no "br": a is the off
        {"world": 2, "hidden": 4096, "tokens": 8192, "quant": "fp8_static", "a_us": 346.0, "a0_us": 312.0,
         "b_us": 346.0, "b_path": "unfused"},
        {"world": 2, "hidden": 4096, "tokens": 2048, "quant": "fp8_group", "a_us": 112.0, "a0_us": 101.0,
         "b_us": 127.0, "b_path": "fused one-shot"}]})
    variant = {"off": {"ms_per_token": 11.0, "gpu_busy_fraction": 0.4}, "on": {"ms_per_token": 11.5},
               "on_speedup": {"median": 0.957, "min": 0.9, "max": 1.01, "n": 8}, "excluded_pairs": 1}
    write(tmp_path / "decode2", "decode_llama_w2_decode.json", {"meta": META, "phases": {
        "decode": {"rows": [{"batch": 1, "off_ms": 5.0, "on_ms": 4.0, "floor_ms": 3.5, "comm_removed_pct": 66.7}],
                   "partial": True, "incomplete_row": {"batch": 8, "off_ms": 6.0, "on_ms": 5.0}},  # killed before its floor
        "generate": {"variants": {"greedy_b1": variant, "sample_b8": {"error": "boom"}}}}})
    write(tmp_path / "generatedefault2", "decode_llama_w2_generate_default.json", {"meta": META, "phases": {
        "generate": {"mode": "default", "variants": {"greedy_b8": variant}}}})  # compiled without CUDA graphs
    written = matrix.report([str(tmp_path)], tmp_path / "out", "h100x4_test")
    assert sorted(p.name for p in written) == ["matrix_h100x4_test.json", "matrix_h100x4_test.md",
                                               "matrix_h100x4_test.png"]
    rows = json.loads((tmp_path / "out" / "matrix_h100x4_test.json").read_text())["rows"]
    by_path = {(r["path"], r["case"]): r for r in rows}
    assert by_path[("site", "T=1")]["speed"] == 2.0 and by_path[("site", "T=1")]["off"] == 10.0
    # Left unfused: Inductor's graph without and with the pass, not the harness's NCCL call.
    assert by_path[("site", "T=8192")]["off"] == 330.0 and by_path[("site", "T=8192")]["speed"] == pytest.approx(1.003, abs=1e-3)
    quantized = by_path[("site, quantized all-reduce", "8 MiB per rank")]  # not a plain site row
    assert quantized["speed"] == 1.5 and "fp8" in quantized["note"] and "left_unfused" not in quantized
    # Left unfused by the pass: the graph without it; flagged, with why, not hidden.
    assert by_path[("site, quantized all-reduce", "16 MiB per rank")]["left_unfused"]
    # A quant site left unfused is compared with the harness's own unfused graph (NCCL on a copy); a fused one
    # with NCCL in place, where the pass's kernel lost (0.795x) and is flagged as slower.
    assert by_path[("site", "T=8192 fp8_static")]["speed"] == 1.0
    assert by_path[("site", "T=2048 fp8_group")]["off"] == 101.0
    assert not [r for r in rows if r["path"] == "site" and "MiB" in r["case"]]
    step = by_path[("decode step (CUDA graph)", "batch 1")]
    assert step["speed"] == 1.25 and step["floor"] == 3.5 and step["comm_removed_pct"] == 66.7
    cut = by_path[("decode step (CUDA graph)", "batch 8")]  # a batch cut short keeps its off and on
    assert cut["speed"] == 1.2 and "floor" not in cut
    gen = by_path[("HF generate()", "greedy, batch 1")]
    assert gen["speed"] == 0.957 and gen["spread"] == [0.9, 1.01] and gen["pairs"] == 8
    assert by_path[("HF generate()", "greedy, batch 8, default mode (no CUDA graphs)")]["speed"] == 0.957
    assert not [r for r in rows if "sample" in r["case"]]  # a failed variant makes no row
    assert {r["date"] for r in rows} == {"2026-11-27"} and rows[0]["versions"]["transformers"] == "5.24.0"
    md = (tmp_path / "out" / "matrix_h100x4_test.md").read_text()
    assert "0.906× **below 0.98** (left unfused: the graph without the pass)" in md
    assert "0.795× **below 0.98** |" in md
    assert "GPU busy 40% / ? (off / on); 1 excluded (graphs recorded again)" in md
    assert "0.957× **below 0.98** (within its spread)" in md and "| 5.24.0 |" in md and "removes 67% of the all-reduces' time" in md
    assert (tmp_path / "out" / "matrix_h100x4_test.png").stat().st_size > 10_000


def test_report_merges_serving_off_and_on_run_apart(tmp_path):
    """serve2 off and serve2 on at once on two GPU pairs: two files, one row set, also with a run of
    both configs of that setup among them; a lone config makes no row."""
    pytest.importorskip("matplotlib")
    meta = {**META, "prompt": 512, "new": 128, "cuda_graphs": True}
    mix = lambda tps, itl: {"tokens_per_s": tps, "itl_ms": itl, "ttft_ms": 100.0}  # noqa: E731
    timed = lambda *tps: {"calls": [{"tokens_per_s": t, "itl_ms": 25.0, "ttft_ms": 100.0} for t in tps]}  # noqa: E731
    write(tmp_path / "serve2_configs_off", "serving_llama_w2.json", {"meta": meta, "configs": {"off": {}},
          "mixes": {"1": {"off": mix(40.0, 25.0)}, "16": {"off": {**mix(500.0, 30.0), **timed(500.0, 520.0)}}}})
    write(tmp_path / "serve2_configs_on", "serving_llama_w2.json", {"meta": meta, "configs": {"on": {}},
          "mixes": {"1": {"on": mix(42.0, 23.8)}, "16": {"on": {**mix(560.0, 28.0), **timed(550.0, 572.0)}}}})
    write(tmp_path / "serve4_configs_on", "serving_llama_w4.json", {"meta": {**meta, "world": 4},
          "configs": {"on": {}}, "mixes": {"1": {"on": mix(50.0, 20.0)}}})
    # A run of both configs of the same setup (sorted between them) keeps them apart from it.
    write(tmp_path / "serve2_configs_offon", "serving_llama_w2.json", {"meta": meta, "configs": {"off": {}, "on": {}},
          "mixes": {"64": {"off": mix(900.0, 60.0), "on": mix(950.0, 57.0)}}})
    # Another KV padding is another setup: its lone "off" joins nothing.
    write(tmp_path / "serve2_kv", "serving_llama_w2.json", {"meta": {**meta, "kv_padding": 256},
          "configs": {"off": {}}, "mixes": {"1": {"off": mix(60.0, 15.0)}}})
    # Flash Attention 3's decode fast path: its own setup, its off and on joined, its attention named;
    # calls started together with a short idle wait (bench_serving.py since 2026-11-28), said in the note.
    for config, tps in (("off", 70.0), ("on", 77.0)):
        write(tmp_path / f"serve2_fa3_{config}", "serving_llama_w2.json", {"meta": {
              **meta, "attn": "flash_attention_3", "idle_wait_ms": 1.0}, "configs": {config: {}},
              "mixes": {"16": {config: mix(tps, 20.0)}}})
    # The same with transformers' own idle wait is another setup: its lone "off" joins neither.
    write(tmp_path / "serve2_fa3_slow", "serving_llama_w2.json", {"meta": {
          **meta, "attn": "flash_attention_3", "idle_wait_ms": 100.0}, "configs": {"off": {}},
          "mixes": {"16": {"off": mix(10.0, 20.0)}}})
    matrix.report([str(tmp_path)], tmp_path / "out", "m")
    rows = json.loads((tmp_path / "out" / "matrix_m.json").read_text())["rows"]
    assert {r["tp"] for r in rows} == {2} and len(rows) == 12
    fa3 = {r["case"]: r for r in rows}["16 requests, tokens/s, flash_attention_3"]
    assert fa3["speed"] == 1.1 and fa3["note"].endswith("; calls started together, idle wait 1 ms")
    tps = {r["case"]: r for r in rows if r["unit"] == "tokens/s"}
    assert tps["16 requests, tokens/s"]["speed"] == 1.12 and "two GPU pairs" in tps["16 requests, tokens/s"]["note"]
    # The spread pairs the i-th timed calls: 550 / 500 and 572 / 520.
    assert tps["16 requests, tokens/s"]["spread"] == [1.1, 1.1] and tps["16 requests, tokens/s"]["pairs"] == 2
    assert "spread" not in tps["1 requests, tokens/s"]
    itl = {r["case"]: r for r in rows if r["unit"] == "ms inter-token"}
    assert itl["1 requests, ms inter-token"]["speed"] == pytest.approx(25.0 / 23.8, abs=1e-4)


def test_interleaved_serving_rows_pair_calls_by_round():
    """bench_serving.py --interleave: the rows take bench_serving's on / off per round (`pairs`, made
    only of rounds where both calls were steady) as speeds; the row's speed is their median, as for generate()."""
    medians = {"tokens_per_s": 250.0, "itl_ms": 4.0, "ttft_ms": 80.0}
    # on / off of rounds 0, 2 and 3 (off 4.0, 3.0, 4.0 ms; on 3.0, 4.5, 4.4 ms); round 1 had no steady "on" call
    row = {"off": medians, "on": {**medians, "itl_ms": 4.5},
           "pairs": {"itl_ms": [0.75, 1.5, 1.1], "tokens_per_s": [1.3333, 0.6667, 0.9091], "ttft_ms": [1.0, 1.0, 1.0]}}
    data = {"meta": {**META, "interleave": True, "fake_world": 2}, "configs": {"off": {}, "on": {}}, "mixes": {"64": row}}
    rows = {r["unit"]: r for r in matrix.rows_from(Path("serving_llama_w2_fake.json"), data)}
    itl = rows["ms inter-token"]  # speed: off / on of a time, on / off of a rate
    assert itl["pairs"] == 3 and itl["spread"] == [0.6667, 1.3333] and itl["speed"] == 0.9091
    assert rows["tokens/s"]["speed"] == 0.9091 and itl["on"] == 4.5  # the medians stay as measured
    assert itl["note"].startswith("in one process, calls interleaved") and itl["path"] == "generate_batch (fake world)"
    assert itl["stand_in"]
    # Older runs name it only in their command.
    del data["meta"]["interleave"]
    data["meta"]["command"] = "python benchmarks/bench_serving.py --fake-world 2 --interleave"
    assert next(iter(matrix.rows_from(Path("serving_llama_w2_fake.json"), data)))["note"].startswith(
        "in one process, calls interleaved")


def test_moe_rows_say_when_the_finalize_kernel_ran(tmp_path):
    meta = {**META, "model_type": "qwen3_moe", "layers": 24, "hidden": 2048}
    step = {"decode": {"rows": [{"batch": 1, "off_ms": 5.0, "on_ms": 4.0}]}}
    write(tmp_path / "moe2", "decode_qwen3_moe_w2_moe.json", {"meta": meta, "phases": step})
    write(tmp_path / "moe2_fin", "decode_qwen3_moe_w2_moe.json", {"meta": {**meta, "moe_finalize": True}, "phases": step})
    rows = [r for f in sorted(tmp_path.rglob("*.json")) for r in matrix.rows_from(f)]
    assert sorted(r["model"] for r in rows) == ["qwen3_moe 24L h2048", "qwen3_moe 24L h2048, MoE finalize"]


def test_goals_read_each_row_by_its_measure():
    """Times give the share saved, rates the gain; a goal without rows says "not measured"."""
    common = {"versions": {"transformers": "5.24.0"}, "machine": "m"}
    rows = [{**common, "path": "decode step (CUDA graph)", "model": "llama 32L h4096", "tp": 2, "case": "batch 1",
             "speed": 1.25, "comm_removed_pct": 70.0},  # 5.0 -> 4.0 ms: 20% less time
            {**common, "path": "generate_batch", "model": "llama 32L h4096", "tp": 2, "case": "16 requests, tokens/s",
             "speed": 1.05, "spread": [0.99, 1.1], "pairs": 6},
            # the quantized all-reduce: against the exact path (1.19x), not against NCCL (1.56x)
            {**common, "path": "site, quantized all-reduce", "model": "hidden 4096", "tp": 2, "case": "8 MiB per rank",
             "speed": 1.56, "vs_exact": 1.19},
            # a goal that names a family (qwen3_moe) says which model each row ran
            {**common, "path": "decode step (CUDA graph)", "model": "qwen3_moe 8L h2048, MoE finalize", "tp": 2,
             "case": "batch 1", "speed": 1.139},
            # the 70B shape's 80 layers from 20 layers' weights
            {**common, "path": "HF generate()", "model": "llama 80L h8192 (20 unique)", "tp": 4,
             "case": "greedy, batch 1", "speed": 1.05, "spread": [1.01, 1.09], "pairs": 8},
            # one GPU standing in for TP=4 checks a path, not a user's speed: no goal reads it
            {**common, "path": "decode step (CUDA graph) (fake world)", "model": "llama 32L h4096", "tp": 4,
             "case": "batch 1", "speed": 1.5, "stand_in": True}]
    table = matrix_goals.goals_table(rows)
    line = lambda what: next(x for x in table.splitlines() if x.startswith(f"| {what} |"))  # noqa: E731
    assert "| 20.0% (batch 1, 5.24.0) |" in line("decode step, Llama-3-8B, batch 1, TP=2") and line(
        "decode step, Llama-3-8B, batch 1, TP=2").endswith("| yes |")
    assert line("all-reduce time removed, Llama-3-8B, batch 1, TP=2").endswith("| **no** |")
    assert "5.0%" in line("generate_batch, 16 requests, tokens/s, TP=2") and "0.990–1.100× (6 pairs)" in table
    assert "| not measured |" in line("decode step, Llama-3-8B, batch 1, TP=4")
    assert "| 12.2% (qwen3_moe 8L h2048, MoE finalize, batch 1, 5.24.0) |" in line(
        "MoE decode step, Qwen3-30B-A3B shape, batch 1, TP=2")
    assert "| 1.050× (llama 80L h8192 (20 unique), greedy, batch 1, 5.24.0) |" in line(
        "HF generate(), faster, Llama-3-70B shape, TP=4") and line("HF generate(), faster, Llama-3-70B shape, TP=4"
                                                                  ).endswith("| yes |")
    assert "| 1.190× (hidden 4096, 8 MiB per rank, 5.24.0) |" in line("quantized all-reduce, 8 MiB per rank, TP=2") and line(
        "quantized all-reduce, 8 MiB per rank, TP=2").endswith("| **no** |")
    rows[0].pop("comm_removed_pct")  # measured without the floor
    assert "not in this row (batch 1)" in matrix_goals.goals_table(rows)


def test_goals_plot_draws_a_strip_per_goal(tmp_path):
    """--plot draws every goal, measured or not, to one PNG beside the table."""
    pytest.importorskip("matplotlib")
    row = {"versions": {"transformers": "5.24.0"}, "machine": "h200x2_2026-11-28_h", "path": "decode step (CUDA graph)",
           "model": "llama 32L h4096", "tp": 2, "case": "batch 1", "speed": 1.18, "comm_removed_pct": 78.5}
    (tmp_path / "matrix_h.json").write_text(json.dumps({"rows": [row]}))
    png = tmp_path / "goals.png"
    assert matrix_goals.main([str(tmp_path / "matrix_h.json"), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_one_gpu_stand_in_stages_run_as_one_plain_process(tmp_path):
    """A --fake-world stage (one GPU standing for TP=2's host path) runs as one python process, not
    under torchrun (bench_hf_decode refuses that); its rows say what stood in for the all-reduces."""
    for name in ("defaultstandin1", "defaultstandinmoe1"):
        cmd = matrix.stage_command(name, Path("/o"), 0, 560)
        assert "torch.distributed.run" not in cmd and cmd[1].endswith("bench_hf_decode.py")
        assert {"--fake-world", "--nccl-host-path", "--flashinfer-host-path"} <= set(cmd)
        assert matrix.parse_spec(f"{name}@0")[1] == [0]
    variant = {"off": {"ms_per_token": 24.0}, "on": {"ms_per_token": 20.0}, "excluded_pairs": 0,
               "on_speedup": {"median": 1.2, "min": 0.9, "max": 1.5, "n": 12}}
    data = {"meta": {"model_type": "llama", "layers": 32, "hidden": 4096, "world": 2, "fake_world": 2,
                     "all_reduces_on_one_rank": 100, "device": "NVIDIA H200", "date": "2026-11-29 11:49"},
            "phases": {"generate": {"mode": "default", "variants": {"greedy_b1": variant}}}}
    (row,) = matrix.rows_from(tmp_path / "decode_llama_w2_fake2.json", data)
    assert row["path"] == "HF generate() (fake world, NCCL's host path)" and row["speed"] == 1.2
    assert row["case"] == "greedy, batch 1, default mode (no CUDA graphs)" and row["pairs"] == 12


def test_a_carried_transformers_goes_in_with_the_wheels_of_its_deps_folder(tmp_path, monkeypatch):
    """transformers 5.25 needs huggingface_hub 2.4, which the GPU machines lack: the wheels of the
    folder TRANSFORMERS_DEPS names go in with the carried wheel (none without it), and hub kernels
    are off (no network there)."""
    (tmp_path / "hub").mkdir()
    for name in ("transformers-9.9.9-py3-none-any.whl", "hub/huggingface_hub-2.4.0-py3-none-any.whl",
                 "hub/httpx2-2.17.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    installs = []
    monkeypatch.setattr(matrix.subprocess, "run", lambda cmd, check: installs.append(cmd))
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    wheel = str(tmp_path / "transformers-9.9.9-py3-none-any.whl")
    env = matrix.stage_env(None, {"TRANSFORMERS_WHEEL": wheel, "TRANSFORMERS_DEPS": str(tmp_path / "hub")})
    assert [Path(p).name for p in installs[0][-3:]] == [
        "transformers-9.9.9-py3-none-any.whl", "httpx2-2.17.0-py3-none-any.whl", "huggingface_hub-2.4.0-py3-none-any.whl"]
    assert "TRANSFORMERS_DEPS" not in env
    matrix.stage_env(None, {"TRANSFORMERS_WHEEL": wheel})
    assert installs[1][-1] == wheel  # the wheel alone
    assert env["PYTHONPATH"].startswith("/tmp/transformers-transformers-9.9.9-py3-none-any:")
    assert env["USE_HUB_KERNELS"] == "0"



def test_a_staged_transformers_tarball_is_unpacked_ahead_of_the_machines(tmp_path, monkeypatch):
    """benchmarks/device/stage_transformers.py packs transformers with its hub as a .tar.xz (3x
    smaller than the wheels, so .device, .fa3 and it fit one call): a stage given it unpacks it into
    a folder of its own, once, puts that first on PYTHONPATH and names its results folder by it."""
    name = f"transformers-0.0.{uuid.uuid4().int % 10**9}"
    site = tmp_path / "site" / "transformers"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("__version__ = '0.0.1'\n")
    tarball = tmp_path / f"{name}.tar.xz"
    with tarfile.open(tarball, "w:xz") as tar:
        tar.add(site, arcname="transformers")
    target = Path("/tmp") / f"transformers-{name}"
    try:
        env = matrix.stage_env(None, {"TRANSFORMERS_WHEEL": str(tarball)})
        assert (target / "transformers" / "__init__.py").read_text() == "__version__ = '0.0.1'\n"
        assert env["PYTHONPATH"].startswith(f"{target}:") and env["USE_HUB_KERNELS"] == "0"
        monkeypatch.setattr(matrix.subprocess, "run", lambda *a, **k: pytest.fail("unpacked twice"))
        matrix.stage_env(None, {"TRANSFORMERS_WHEEL": str(tarball)})
    finally:
        shutil.rmtree(target, ignore_errors=True)
    assert matrix.stage_folder("serve2", [], {"TRANSFORMERS_WHEEL": f".whl/{name}.tar.xz"}) \
        == f"serve2_TRANSFORMERSWHEEL{name.replace('-', '')}"
