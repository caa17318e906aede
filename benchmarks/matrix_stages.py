"""The speed matrix's stages: what each measures, on how many GPUs, under which time limit, by
which command (benchmarks/matrix.py runs them and reports their results)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Stage:
    gpus: int
    limit_s: int
    script: str
    args: str
    what: str


LLAMA_DECODE = "--phases decode kernels --floor --batches 1 8 32 --replays 200"
GENERATE = "--phases generate --pairs 8 --lengths 128 16"  # + its variants: --gen-variants MODE:BATCH ...
PREFILL = "--phases prefill --prefill 512 2048 8192 --quantized fp8 --replays 30"
LLAMA70B = "--model-type llama70b --layers 80 --unique-layers 20"
STANDIN = ("--fake-world 2 --flashinfer-host-path --nccl-host-path --phases generate --generate-mode default "
           "--lengths 24 8 --pairs 12")
STAGES = {
    **{f"site{n}": Stage(n, 200, "bench_fused_op.py", "--hidden 4096 8192", "one site, T = 1 ... 8192, bf16") for n in (2, 4)},
    **{f"sitequant{n}": Stage(n, 240, "bench_fused_op.py",
                              "--hidden 4096 8192 --tokens 1 8 32 128 512 2048 8192 --quant fp8_static fp8_dynamic fp8_group",
                              "one site + FP8 quant (static, dynamic, per-group)") for n in (2, 4)},
    **{f"quantized{n}": Stage(n, 200, "bench_fused_op.py", "--quantized fp8", "the quantized (FP8) all-reduce against "
                              "the exact fused kernel, 1 ... 64 MiB per rank") for n in (2, 4)},
    **{f"quantizedknobs{n}": Stage(n, 420, "bench_fused_op.py", "--quantized fp8 --mib 4 8 16 --codec-knobs",
                                   "the same at 4/8/16 MiB, and FlashInfer's call under 24 launch knobs") for n in (2, 4)},
    **{f"decode{n}": Stage(n, 520, "bench_hf_decode.py", f"{LLAMA_DECODE} --tag decode",
                           "Llama-3-8B decode step in one CUDA graph, batch 1/8/32, with the floor") for n in (2, 4)},
    **{f"generate{n}": Stage(n, 540, "bench_hf_decode.py", f"{GENERATE} --gen-variants greedy:1 sample:1 greedy:8 sample:8 --tag generate",
                             "HF generate(), greedy and sampling, batch 1 and 8, 8 interleaved pairs") for n in (2, 4)},
    # The sampling variants alone: at TP=4 four variants do not fit one call (greedy at batch 1 and 8: 290 s, 2026-11-28).
    **{f"generatesample{n}": Stage(n, 540, "bench_hf_decode.py", f"{GENERATE} --gen-variants sample:1 sample:8 --tag "
                                   "generate_sample", "HF generate(), sampling only, batch 1 and 8, 8 pairs") for n in (2, 4)},
    **{f"generatedefault{n}": Stage(n, 540, "bench_hf_decode.py", f"{GENERATE} --generate-mode default --gen-variants "
                                    "greedy:1 greedy:8 --tag generate_default", "HF generate() without CUDA graphs "
                                    "(every step launched by the host), greedy, batch 1 and 8, 8 pairs") for n in (2, 4)},
    **{f"prefill{n}": Stage(n, 420, "bench_hf_decode.py", f"{PREFILL} --tag prefill",
                            "prefill 512/2048/8192, with and without the quantized all-reduce") for n in (2, 4)},
    # A config's first call (compile, capture) takes ~230 s at 32 layers on H100: off and on of one
    # stage do not fit one call. serve2: off and on at once on two GPU pairs (serve2@0,1:--configs=off
    # + serve2@2,3:--configs=on); serve4: off and on in back-to-back calls. Both configs with their
    # calls alternating (:--interleave) fit one call with fewer layers (:--layers=16).
    **{f"serve{n}": Stage(n, 560, "bench_serving.py", "--mixes 1,16,64 --repeats 6",
                          "generate_batch at 1/16/64 requests: TTFT, ITL, tokens/s (one config per run: :--configs=off)")
       for n in (2, 4)},
    # The 70B shape's 80 layers from 20 layers' weights (35 GB to write and load), each reused 4 times in turn.
    **{f"decode{n}_70b": Stage(n, 560, "bench_hf_decode.py", f"{LLAMA70B} --phases decode --floor --batches 1 8 32 "
                               "--replays 100 --tag decode70b", "Llama-3-70B shape decode step, with the floor")
       for n in (2, 4)},
    **{f"generate{n}_70b": Stage(n, 560, "bench_hf_decode.py", f"{LLAMA70B} {GENERATE} --gen-variants greedy:1 --tag "
                                 "generate70b", "HF generate() of the Llama-3-70B shape, greedy, batch 1, 8 pairs")
       for n in (2, 4)},
    # With FlashInfer's MoE finalize kernel: moe2:ARFUSION_FLASHINFER_MOE_FINALIZE=1 (its own folder).
    # 420 s was short at 24 layers on 4xH100 (2026-11-28: 100 s to write and load, batch 8 not reached).
    "moe2": Stage(2, 560, "bench_hf_decode.py", "--model-type qwen3_moe --layers 24 --phases decode kernels --floor "
                  "--batches 1 8 --tag moe", "Qwen3-30B-A3B shape decode step, 24 of 48 layers, with the floor"),
    # Without CUDA graphs, one H200 standing in for TP=2: 0.58-1.48x with off's all-reduces on the fake
    # group (machine V), 1.07x and 1.11x with them on NCCL's host path (machine W, docs/benchmarks.md).
    # The lent hosts' speed swings up to 2x from call to call: many short pairs.
    "generatedefaultmoe2": Stage(2, 560, "bench_hf_decode.py", "--model-type qwen3_moe --layers 24 --unique-layers 4 "
                                 "--phases generate --pairs 16 --lengths 24 8 --generate-mode default --gen-variants "
                                 "greedy:1 --tag generate_default_moe", "HF generate() of the Qwen3-30B-A3B shape "
                                 "without CUDA graphs, 24 layers, greedy, batch 1, 16 pairs"),
    # One GPU standing for TP=2's host path (a fake world whose all-reduces run NCCL's host path on one
    # rank; the pass on FlashInfer's host path, kernel skipped): what one-GPU sessions can run.
    **{f"defaultstandin{m}1": Stage(1, 560, "bench_hf_decode.py", f"{STANDIN} {shape} --tag generate_default{m}_standin",
                                    f"TP=2's host path on one GPU: HF generate() without CUDA graphs, {what}, 12 pairs")
       for m, shape, what in (("", "--gen-variants greedy:1 greedy:8", "Llama-3-8B, greedy, batch 1 and 8"),
                              ("moe", "--model-type qwen3_moe --layers 24 --unique-layers 4 --gen-variants greedy:1 "
                               "sample:1", "Qwen3-30B-A3B, 24 layers, greedy and sampling, batch 1"))},
    "moe2dsv2": Stage(2, 560, "bench_hf_decode.py", "--model-type deepseek_v2 --phases decode kernels --floor "
                      "--batches 1 8 --tag moe", "DeepSeek-V2-Lite shape decode step, all 27 layers, with the floor")}


def plan() -> str:
    lines = [f"{'stage':<20} {'GPUs':>4} {'limit':>6}  what / command"]
    for name, s in STAGES.items():
        lines.append(f"{name:<20} {s.gpus:>4} {s.limit_s:>5}s  {s.what}\n{'':<33}benchmarks/{s.script} {s.args}")
    return "\n".join(lines)
