"""The GPU check scripts of tests/gpu, each launched as benchmarks/device/device_run.sh's stage
launches it, asserted on its exit code and its JSON. (check_flashinfer.py and
check_first_call_in_cudagraphs.py: test_gpu_flashinfer.py.)

Scripts that can put both ranks on one GPU (`--shared-gpu`: gloo, FlashInfer's world-2 kernels,
what is computed, not speed; tests/gpu/shared_gpu.py) run twice: `two_gpus` (NCCL, one GPU per
rank) and `shared_gpu` (needs one GPU). Each is skipped with the reason where this machine lacks
the GPUs, FlashInfer or transformers. Select with -k, e.g. `pytest tests/gpu -k shared_gpu` on a
one-GPU machine. Limits are the stages' (device_run.sh) with room for FlashInfer's JIT.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from gpu_launch import has_module, needs

GPU = "tests/gpu"
MODES = [pytest.param("two_gpus", marks=needs(gpus=2)), pytest.param("shared_gpu", marks=needs(gpus=1))]
# The faults and the soak also at TP=4 (NCCL, one GPU per rank): their scripts take any world size.
MODES_TP4 = [*MODES, pytest.param("four_gpus", marks=needs(gpus=4))]


def shared(mode: str) -> list[str]:
    return ["--shared-gpu"] if mode == "shared_gpu" else []


def ranks(mode: str) -> int:
    return 4 if mode == "four_gpus" else 2


@pytest.mark.parametrize("world", [pytest.param(2, marks=needs(gpus=2)), pytest.param(4, marks=needs(gpus=4))])
def test_quant_sites(world, launch):
    """check_quant.py: every FP8 form on FlashInfer vs arfusion.quant's reference (qchecks2 / qchecks4)."""
    done = launch(f"{GPU}/check_quant.py", nproc=world, timeout=400)
    assert done.returncode == 0, done.tail()
    results = done.json(f"gpu_quant_checks_w{world}.json")
    assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]


@pytest.mark.parametrize("mode", MODES)
def test_bad_inputs(mode, launch):
    """check_bad_inputs.py: tests/bad_input_cases.py through FlashInfer (bad1shared)."""
    done = launch(f"{GPU}/check_bad_inputs.py", *shared(mode), "--out", "{out}", nproc=2,
                  env={"CHECK_HANG_S": "400"}, timeout=480)
    assert done.returncode == 0, done.tail()
    for rank in range(2):
        report = done.json(f"bad_inputs_rank{rank}.json")
        assert report["results"] and report["problems"] == [], (rank, report["problems"])


def fault_case(launch, mode: str, case: str, cache: str):
    done = launch(f"{GPU}/check_faults.py", *shared(mode), "--case", case, "--cache", cache, "--out", "{out}",
                  nproc=ranks(mode), env={"CHECK_HANG_S": "300"}, timeout=360)
    assert done.returncode == 0, f"{case}:\n{done.tail()}"
    for rank in range(ranks(mode)):
        recorded = done.json(f"{case}/rank{rank}.json")
        assert case in recorded and recorded["problems"] == [], (case, rank, recorded.get("problems"))


@pytest.mark.parametrize("mode", MODES_TP4)
def test_faults_compile_cache_cold_then_warm(mode, launch, tmp_path):
    """check_faults.py cold, then warm in fresh processes: a cache hit must still create
    FlashInfer's workspace and run the kernel (faults1shared / faults2, cases cold warm)."""
    cache = str(tmp_path / "inductor-cache")
    fault_case(launch, mode, "cold", cache)
    fault_case(launch, mode, "warm", cache)


@pytest.mark.parametrize("case", ["fail_build", "low_memory", "fail_create"])
@pytest.mark.parametrize("mode", MODES_TP4)
def test_faults_one_rank_failing(mode, case, launch, tmp_path):
    """check_faults.py: FlashInfer fails on rank 1 only; both ranks run unfused and correct.
    fail_create waits out the workspace exchange's 60 s timeout (FAULT_CASES=fail_create)."""
    fault_case(launch, mode, case, str(tmp_path / "inductor-cache"))


@pytest.mark.parametrize("mode", MODES)
def test_moe_combine(mode, launch):
    """check_moe_combine.py: the MoE combine fused into the site (FlashInfer's finalize, opted in)
    against the unfused reference; two_gpus also times it (moecheck2 / moecheck1shared). No new
    case starts after 210 s; what ran must be within tolerance."""
    done = launch(f"{GPU}/check_moe_combine.py", *shared(mode), "--budget-s", "210", "--out", "{out}", nproc=2,
                  env={"CHECK_HANG_S": "200"}, timeout=420)
    assert done.returncode == 0, done.tail()
    for rank in range(2):
        results = done.json(f"moe_combine_rank{rank}.json")
        assert results["cases"] and results["failures"] == [], (rank, results.get("failures"))
        if mode == "shared_gpu":  # the CUDA graph of the finalize kernel, replayed, last
            assert "graph_probe" in results, rank


@needs(gpus=1, modules=("flashinfer.comm.quantized_allreduce",))
def test_quantized_codec(launch):
    """check_quantized_codec.py: arfusion's fp8 emulation errs as FlashInfer's quantized
    all-reduce does (one rank, one GPU)."""
    done = launch(f"{GPU}/check_quantized_codec.py", "--out", "{out}", nproc=1, timeout=300)
    assert done.returncode == 0, done.tail()
    report = done.json("quantized_codec.json")
    assert report["rows"] and report["failures"] == 0, report["failures"]


def skip_unless_looped_experts() -> None:
    """check_loop_free_experts.py needs LongCat-Flash's looped experts: transformers <= 5.24 (5.25's
    have no loop; a wheel trimmed of models has no LongCat-Flash at all)."""
    if not has_module("transformers.models.longcat_flash"):
        pytest.skip("the installed transformers has no LongCat-Flash model")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.models import looped_longcat_experts

    if not looped_longcat_experts():
        pytest.skip("the installed transformers' LongCat-Flash experts have no loop (transformers >= 5.25)")


@needs(gpus=1, modules=("transformers",))
def test_loop_free_experts_one_gpu(launch):
    """check_loop_free_experts.py: LongCat-Flash's experts without their loop, one process
    (numerics, fullgraph compile, CUDA graphs, time; loopfree1)."""
    skip_unless_looped_experts()
    done = launch(f"{GPU}/check_loop_free_experts.py", "--out", "{out}", timeout=420)
    assert done.returncode == 0, done.tail()
    assert done.json("loop_free_experts.json")["rows"]


@needs(gpus=1, modules=("transformers",))
@pytest.mark.parametrize("finalize", [False, True], ids=["plain", "moe_finalize"])
def test_loop_free_experts_tp2_shared_gpu(finalize, launch):
    """check_loop_free_experts.py --shared-gpu: the same model at TP=2 through the pass with
    FlashInfer, both ranks on GPU 0; moe_finalize opts in FlashInfer's MoE finalize kernel
    (loopfree1shared / loopfree1sharedfin)."""
    skip_unless_looped_experts()
    env = {"CHECK_HANG_S": "300", **({"ARFUSION_FLASHINFER_MOE_FINALIZE": "1"} if finalize else {})}
    done = launch(f"{GPU}/check_loop_free_experts.py", "--shared-gpu", "--out", "{out}", nproc=2, env=env,
                  timeout=360)
    assert done.returncode == 0, done.tail()
    ranks = done.json("loop_free_experts_tp2.json")
    assert len(ranks) == 2 and all(r["stats"]["fused_sites"] for r in ranks), ranks
    assert all(math.isfinite(r["logits_rel_err_vs_eager"]) for r in ranks), ranks
    if finalize:
        assert all(r["fused_moe_kernel_calls"] for r in ranks), ranks


@pytest.mark.parametrize("mode", MODES_TP4)
def test_soak(mode, launch):
    """soak.py: a compiled two-layer TP block under reduce-overhead and dynamic=True, every output
    against eager (soak2 and four_gpus: up to 10000 calls, 115 s a mode; soak1shared: 2000 calls)."""
    args = ["--calls", "2000"] if mode == "shared_gpu" else ["--calls", "10000", "--budget-s", "115"]
    done = launch(f"{GPU}/soak.py", *shared(mode), *args, "--out", "{out}", nproc=ranks(mode),
                  env={"SOAK_HANG_S": "285"}, timeout=360)
    assert done.returncode == 0, done.tail()
    report = done.json("soak.json")
    assert report["backend"] == "flashinfer" and report["world_size"] == ranks(mode), report
    for m in report["modes"]:
        assert m["calls"] > 0 and m["mismatches_all_ranks"] == 0, (m["mode"], m["mismatches_all_ranks"], m["worst"])


@needs(gpus=2)
def test_two_jobs_on_the_same_two_gpus(gpu_out):
    """Two TP=2 jobs at once on GPUs 0 and 1 (two servers sharing a node): each its own torchrun,
    FlashInfer workspaces and compile caches; both soak runs end with no wrong result and no hang."""
    from concurrent.futures import ThreadPoolExecutor

    from gpu_launch import Launcher

    def job(i: int):
        return Launcher(gpu_out, f"two_jobs_{i}")(f"{GPU}/soak.py", "--calls", "3000", "--budget-s", "100",
                                                  "--seed", str(i), "--out", "{out}", nproc=2,
                                                  env={"SOAK_HANG_S": "240", "CUDA_VISIBLE_DEVICES": "0,1"},
                                                  timeout=330)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(job, (0, 1)))
    for done in runs:
        assert done.returncode == 0, done.tail()
        report = done.json("soak.json")
        assert report["backend"] == "flashinfer", report["backend"]
        for m in report["modes"]:
            assert m["calls"] > 0 and m["mismatches_all_ranks"] == 0, (m["mode"], m["mismatches_all_ranks"], m["worst"])


@pytest.mark.parametrize("mode", MODES)
def test_fast_all_reduce(mode, launch):
    """check_fast_all_reduce.py: a LayerNorm block and a DeepSeek-V4-shaped hyper-connection block,
    every all-reduce on FlashInfer's plain one-shot kernel, eager and reduce-overhead, against
    eager; an RMSNorm site with a 0-d GPU eps buffer fuses (fastar2 / fastar1shared)."""
    done = launch(f"{GPU}/check_fast_all_reduce.py", *shared(mode), "--out", "{out}", nproc=2,
                  env={"CHECK_HANG_S": "300"}, timeout=400)
    assert done.returncode == 0, done.tail()
    ranks = done.json("fast_all_reduce.json")
    assert len(ranks) == 2 and not any(r["failures"] for r in ranks), [r["failures"] for r in ranks]


@pytest.mark.parametrize("mode", MODES)
def test_fallback_all_reduce(mode, launch):
    """check_fallback_all_reduce.py: the fused op's unfused all-reduce equals an all-reduce, eagerly
    and replayed from a CUDA graph on new inputs, and leaves its input as it was (fallbackar2 /
    fallbackar1shared)."""
    done = launch(f"{GPU}/check_fallback_all_reduce.py", *shared(mode), "--out", "{out}", nproc=2,
                  env={"CHECK_HANG_S": "300"}, timeout=300)
    assert done.returncode == 0, done.tail()
    ranks = done.json("fallback_all_reduce.json")
    assert len(ranks) == 2 and all(r["ok"] for e in ranks for r in e["rows"]), ranks


@needs(gpus=1, modules=("transformers",))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "cuda_graphs"])
def test_continuous_batching(mode, graphs, launch):
    """check_continuous_batching.py: transformers' generate_batch at TP=2 with the pass on FlashInfer,
    every all-reduce fused or merged, greedy tokens as eager's up to near ties; with transformers' own
    CUDA graphs every fused call captured (cbshared / cbgraphsshared / cb2 / cbgraphs2)."""
    args = ["--shared-gpu" if mode == "shared_gpu" else "--two-gpus", *(["--cuda-graphs"] if graphs else [])]
    done = launch(f"{GPU}/check_continuous_batching.py", *args, "--out", "{out}", nproc=2,
                  env={"CHECK_HANG_S": "280"}, timeout=330)
    assert done.returncode == 0, done.tail()
    ranks = done.json("continuous_batching" + ("_cuda_graphs" if graphs else "") + ".json")
    results = [r for rank in ranks for r in rank["results"]]
    assert results and not [r for r in results if r["problems"]], [r for r in results if r["problems"]]
    ran = [r for r in results if "dispatch" in r]  # not the models whose own code failed without the pass too
    assert ran and any(not r.get("upstream") for r in ran), results
    for r in results:
        if r.get("upstream"):
            print(f"{r['model']}: transformers' own limit: {r['upstream']}")
    if graphs:
        assert all(r["dispatch_in_cuda_graphs"] for r in ran), ran
