#!/usr/bin/env bash
# Stages of a GPU session, each under its own time limit so one hang cannot eat the rest.
# On the GPU machine, from the repository root:
#   source .device/setup.sh && bash benchmarks/device/device_run.sh sweep4 checks2 checks4 sweep2
# Results land in $OUT (JSON per stage); the log is whatever the caller tees.
set -u
OUT="${OUT:-/tmp/arfusion-out}"
mkdir -p "$OUT"
export OUT

stage() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@"
  echo "=== $name rc=$? after $((SECONDS - start))s"
}

TORCHRUN="python -m torch.distributed.run --nproc-per-node"
# TRANSFORMERS_WHEEL=path: run the stages with that transformers (carried in .whl/), not the machine's.
# Stage it once on the CPU machine: python benchmarks/device/stage_transformers.py 5.25.0
if [ -n "${TRANSFORMERS_WHEEL:-}" ]; then
  tf_dir=/tmp/transformers-$(basename "$(basename "$TRANSFORMERS_WHEEL" .whl)" .tar.xz)
  # TRANSFORMERS_DEPS=folder: its wheels go in too (transformers >= 5.25 needs huggingface_hub 2.4);
  # a .tar.xz from stage_transformers.py holds them already and is unpacked
  if [ -d "$tf_dir" ]; then :
  elif [[ "$TRANSFORMERS_WHEEL" == *.tar.xz ]]; then mkdir -p "$tf_dir" && tar xJf "$TRANSFORMERS_WHEEL" -C "$tf_dir"
  else python -m pip install -q --no-deps --no-compile --target "$tf_dir" "$TRANSFORMERS_WHEEL" \
    ${TRANSFORMERS_DEPS:+"$TRANSFORMERS_DEPS"/*.whl}
  fi
  export PYTHONPATH="$tf_dir${PYTHONPATH:+:$PYTHONPATH}" USE_HUB_KERNELS="${USE_HUB_KERNELS:-0}"
fi
TF_TAG=$(python -c "import transformers; print(transformers.__version__)" 2>/dev/null)
CB_MODELS="${CB_MODELS:-llama,qwen3_moe,aria_text,gemma3_text}"
GPU_TESTS=tests/gpu/test_gpu_flashinfer.py

for s in "$@"; do
  case "$s" in
    env) stage env 60 bash -c 'nvidia-smi -L; nvidia-smi topo -m | head -8; python -c "import torch, time; t=time.time(); import flashinfer.comm; print(\"torch\", torch.__version__, \"flashinfer import\", round(time.time()-t,1), \"s\")"' ;;
    checks2) stage checks2 "${LIMIT:-120}" python -m pytest -q -s -x "$GPU_TESTS::test_fused_op_matches_reference_on_gpus[2]" ;;
    checks4) stage checks4 "${LIMIT:-150}" python -m pytest -q -s -x "$GPU_TESTS::test_fused_op_matches_reference_on_gpus[4]" ;;
    hf2) stage hf2 "${LIMIT:-100}" python -m pytest -q -s -x "$GPU_TESTS::test_hf_example_runs_fused_on_two_gpus" ;;
    meaning2) stage meaning2 "${LIMIT:-300}" python -m pytest -q -s "$GPU_TESTS::test_hf_example_fuses_every_site_by_meaning" ;;
    checks2+hf2)  # both correctness-only: run side by side on GPUs 0,1 and 2,3
      (CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 stage hf2 "${LIMIT:-120}" python -m pytest -q -s -x \
        "$GPU_TESTS::test_hf_example_runs_fused_on_two_gpus" >/tmp/hf2.log 2>&1) &
      CUDA_VISIBLE_DEVICES=0,1 stage checks2 "${LIMIT:-120}" python -m pytest -q -s -x "$GPU_TESTS::test_fused_op_matches_reference_on_gpus[2]"
      wait
      cat /tmp/hf2.log ;;
    sweep2) stage sweep2 "${LIMIT:-170}" $TORCHRUN 2 benchmarks/bench_fused_op.py --variants --out "$OUT/sweep" ;;
    sweep4) stage sweep4 "${LIMIT:-170}" $TORCHRUN 4 benchmarks/bench_fused_op.py --variants --out "$OUT/sweep" ;;
    bench2) stage bench2 "${LIMIT:-140}" $TORCHRUN 2 benchmarks/bench_fused_op.py --hidden ${HIDDEN:-4096 8192} --out "$OUT" ;;
    bench4) stage bench4 "${LIMIT:-140}" $TORCHRUN 4 benchmarks/bench_fused_op.py --hidden ${HIDDEN:-4096 8192} --out "$OUT" ;;
    probe2) stage probe2 "${LIMIT:-90}" $TORCHRUN 2 .device/probe_flashinfer_direct.py ;;
    probe4) stage probe4 "${LIMIT:-90}" $TORCHRUN 4 .device/probe_flashinfer_direct.py ;;
    tune4) stage tune4 "${LIMIT:-70}" $TORCHRUN 4 -m arfusion.cli tune --hidden 4096 --tokens 1,8,32,64,128,192,256,384,512 --cache "$OUT/tuning.json" ;;
    tune2) stage tune2 "${LIMIT:-60}" $TORCHRUN 2 -m arfusion.cli tune --hidden 4096 --tokens 1,8,64,256,1024,4096,8192 --cache "$OUT/tuning.json" ;;
    # The quantized all-reduce's crossover and launch knobs (FlashInfer's own against TUNE_KNOBS), 1 to 64 MiB per rank.
    tuneq2|tuneq4) stage "$s" "${LIMIT:-240}" $TORCHRUN "${s#tuneq}" -m arfusion.cli tune --hidden 4096 --quantized fp8 --knobs \
      --tokens 64,128,256,512,1024,1536,2048,3072,4096,6144,8192 --cache "$OUT/tuning_${s}.json" ;;
    qchecks2) stage qchecks2 "${LIMIT:-150}" $TORCHRUN 2 tests/gpu/check_quant.py ;;
    qchecks4) stage qchecks4 "${LIMIT:-150}" $TORCHRUN 4 tests/gpu/check_quant.py ;;
    qbench2) stage qbench2 "${LIMIT:-200}" $TORCHRUN 2 benchmarks/bench_fused_op.py --hidden 4096 \
      --tokens 1 8 32 128 512 2048 8192 --quant ${QUANTS:-fp8_static fp8_dynamic fp8_group} --out "$OUT" ;;
    qbench4) stage qbench4 "${LIMIT:-200}" $TORCHRUN 4 benchmarks/bench_fused_op.py --hidden 4096 \
      --tokens 1 8 32 128 512 2048 8192 --quant ${QUANTS:-fp8_static fp8_dynamic fp8_group} --out "$OUT" ;;
    qchecks2+qbench2)  # correctness on GPUs 2,3 beside the timing on GPUs 0,1
      (CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 bash "$0" qchecks2 >/tmp/qchecks2.log 2>&1) &
      CUDA_VISIBLE_DEVICES=0,1 bash "$0" qbench2
      wait
      cat /tmp/qchecks2.log ;;
    probeq) stage probeq "${LIMIT:-120}" python benchmarks/probes/probe_group_quant.py ;;
    probeq+qchecks2)  # the one-GPU probe on GPU 0 beside the TP=2 checks on GPUs 2,3
      (CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 bash "$0" qchecks2 >/tmp/qchecks2.log 2>&1) &
      CUDA_VISIBLE_DEVICES=0 bash "$0" probeq
      wait
      cat /tmp/qchecks2.log ;;
    point4) stage point4 "${LIMIT:-60}" $TORCHRUN 4 benchmarks/bench_fused_op.py --hidden 4096 --tokens 2048 \
      --replays 300 --out "$OUT/point4" ;;
    # End to end (Llama-3-8B shape): the headline phases on GPUs 0,1 beside the host-bound ones on GPUs 2,3;
    # each writes its own JSON (tag a / b) after every phase.
    decode2) stage decode2 "${LIMIT:-540}" $TORCHRUN 2 benchmarks/bench_hf_decode.py --phases startup decode accuracy kernels \
      --tag a --ckpt-dir /tmp/ckpt-a --budget-s 440 --out "$OUT" ;;
    decode2b) stage decode2b "${LIMIT:-540}" $TORCHRUN 2 benchmarks/bench_hf_decode.py --phases prefill loop generate \
      --tag b --ckpt-dir /tmp/ckpt-b --budget-s 440 --out "$OUT" ;;
    decode2+decode2b)
      (CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 bash "$0" decode2b >"$OUT/decode2b.log" 2>&1) &
      CUDA_VISIBLE_DEVICES=0,1 bash "$0" decode2
      wait
      tail -25 "$OUT/decode2b.log" ;;
    decode4) stage decode4 "${LIMIT:-560}" $TORCHRUN 4 benchmarks/bench_hf_decode.py \
      --phases decode accuracy kernels prefill loop --budget-s 420 --out "$OUT" ;;
    decode4b) stage decode4b "${LIMIT:-570}" $TORCHRUN 4 benchmarks/bench_hf_decode.py --phases startup loop generate \
      --tag b --budget-s 470 --out "$OUT" ;;
    prefill4) stage prefill4 "${LIMIT:-300}" $TORCHRUN 4 benchmarks/bench_hf_decode.py --phases prefill --tag prefill \
      --out "$OUT" ;;
    # MoE decode: Qwen3-30B-A3B and DeepSeek-V2-Lite shapes, fewer layers, decode + accuracy, and
    # the profiler's GPU time per step by kernel kind (how much of the step the all-reduces are at all).
    moe2) for model in ${MOE_MODELS:-qwen3_moe deepseek_v2}; do
        stage "moe2-$model" "${LIMIT:-280}" $TORCHRUN 2 benchmarks/bench_hf_decode.py --model-type "$model" \
          --layers ${MOE_LAYERS:-8} --phases ${MOE_PHASES:-decode accuracy kernels} --batches 1 8 --steps 8 \
          --ckpt-dir /tmp/ckpt-moe --out "$OUT"
      done ;;
    # The same with FlashInfer's MoE finalize kernel opted in (off by default: it can hang when ranks
    # drift apart, docs/flashinfer.md), tagged apart.
    moe2fin) for model in ${MOE_MODELS:-qwen3_moe deepseek_v2}; do
        stage "moe2fin-$model" "${LIMIT:-280}" env ARFUSION_FLASHINFER_MOE_FINALIZE=1 $TORCHRUN 2 \
          benchmarks/bench_hf_decode.py --model-type "$model" --layers ${MOE_LAYERS:-8} \
          --phases ${MOE_PHASES:-decode accuracy kernels} --batches 1 8 --steps 8 --ckpt-dir /tmp/ckpt-moe --tag finalize --out "$OUT"
      done ;;
    # The MoE site as the pass emits it by default (compiled combine + fused site) against unfused, timed.
    # The MoE site's whole grid (K 8, 2, 6; hidden 2048, 4096, 7168; T 1..512), K = 8 first; no case starts after
    # the budget, so the stage ends with what it measured.
    moesite2) stage moesite2 "${LIMIT:-240}" $TORCHRUN 2 tests/gpu/check_moe_combine.py --no-finalize \
      --budget-s $(( ${LIMIT:-240} - 60 )) --out "$OUT/moe_site" ;;
    moecheck2) stage moecheck2 "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_moe_combine.py \
      --budget-s $(( ${LIMIT:-300} - 90 )) --out "$OUT/moe_combine" ;;
    # Where only one GPU is lent: the same correctness checks with both ranks on GPU 0 (gloo, no timings).
    # Queued calls and CUDA graphs of the MoE op, both ranks on GPU 0 (the finalize race; the last
    # step, an odd graph of MoE calls alone, is expected to hang and be stopped by the watchdog).
    queue1shared) stage queue1shared "${LIMIT:-240}" $TORCHRUN 2 benchmarks/probes/probe_shared_gpu_queue.py ;;
    moecheck1shared) stage moecheck1shared "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_moe_combine.py --shared-gpu \
      --budget-s $(( ${LIMIT:-300} - 90 )) --out "$OUT/moe_combine_shared_gpu" ;;
    # The floor under the MoE decode targets, on one GPU: one rank's share of the TP=2 model
    # run alone (no communication), the same graph-captured step as moe2 times at TP=2.
    floor1) for model in ${MOE_MODELS:-deepseek_v2 qwen3_moe}; do
        stage "floor1-$model" "${LIMIT:-200}" $TORCHRUN 1 benchmarks/bench_hf_decode.py --model-type "$model" \
          --layers ${MOE_LAYERS:-8} --rank-of 2 --phases ${MOE_PHASES:-decode kernels} --batches 1 8 \
          --ckpt-dir /tmp/ckpt-floor --tag rank_of_2 --out "$OUT"
      done ;;
    # Quantized all-reduce: op level at 1-64 MiB per rank (bench_quantized_w2.json),
    # then a Llama-3-8B-shaped prefill off / on / on + fp8 (decode_llama_w2_quantized.json).
    # quantized2 runs both, one after the other (limits 200 + 390 s: near a 10-minute command with
    # setup; where that is the cap, run qop2 and qprefill2 as two commands).
    qop2) stage qop2 "${LIMIT:-200}" $TORCHRUN 2 benchmarks/bench_fused_op.py --quantized fp8 --out "$OUT" ;;
    qprefill2) stage qprefill2 "${LIMIT:-390}" $TORCHRUN 2 benchmarks/bench_hf_decode.py --phases prefill \
      --prefill ${PREFILL:-512 2048 8192} --quantized fp8 --replays 30 --tag quantized --ckpt-dir /tmp/ckpt-a --out "$OUT" ;;
    quantized2) bash "$0" qop2; bash "$0" qprefill2 ;;
    # The trained-model accuracy (docs/accuracy.md) where only one GPU is lent: train the default model on the GPU,
    # then evaluate it at TP=2 on the machine's CPUs (gloo, torch backend: exact, and each quantized
    # level emulated in the format of the GPU kernels). The GPU TP=2 evaluation is acc2.
    trainacc1)
      stage train1 "${LIMIT:-200}" python benchmarks/train_tiny_llama.py --out /tmp/ckpt-acc --steps ${STEPS:-800}
      cp /tmp/ckpt-acc/train_meta.json "$OUT/accuracy_gpu_train_meta.json" 2>/dev/null
      OMP_NUM_THREADS=${THREADS:-8} stage cpuacc2 "${EVAL_LIMIT:-380}" $TORCHRUN 2 benchmarks/eval_accuracy.py \
        --model /tmp/ckpt-acc --cpu --seqs ${SEQS:-32} --out "$OUT" --configs eager compiled arfusion_exact \
        arfusion_fp8 arfusion_int8 arfusion_int6 arfusion_int4 ;;
    acc2) stage acc2 "${LIMIT:-300}" $TORCHRUN 2 benchmarks/eval_accuracy.py --model /tmp/ckpt-acc --out "$OUT" \
      --configs eager compiled arfusion_exact arfusion_fp8 ;;
    # Each mode gets SOAK_BUDGET_S (default: an even share of the limit after ~40 s of start-up), so the
    # stage ends with its results when the calls take longer than hoped.
    soak2) stage soak2 "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/soak.py --calls ${SOAK_CALLS:-10000} \
      --budget-s ${SOAK_BUDGET_S:-$(( (${LIMIT:-300} - 40) / 2 - 15 ))} --out "$OUT/soak" ;;
    loop2) stage loop2 "${LIMIT:-300}" $TORCHRUN 2 benchmarks/bench_hf_decode.py --phases loop --tag loop --out "$OUT" ;;
    startloop2)  # the phase order of the TP=4 run whose loop was slower with the pass, at TP=2
      stage startloop2 "${LIMIT:-420}" $TORCHRUN 2 benchmarks/bench_hf_decode.py --phases startup loop --tag startloop \
      --budget-s 380 --out "$OUT" ;;
    loop4) stage loop4 "${LIMIT:-300}" $TORCHRUN 4 benchmarks/bench_hf_decode.py --phases loop --tag loop --out "$OUT" ;;
    # Every GPU check at once through pytest (tests/gpu: what this machine cannot run is skipped with the
    # reason); JSON and logs in $OUT/gpu.tar.gz (the device tool brings back only so many files, so
    # deep), the summary beside it as $OUT/gpu_summary.json. GPU_K picks checks by name, e.g. GPU_K=shared_gpu.
    gpu) ARFUSION_GPU_OUT="$OUT/gpu" stage gpu "${LIMIT:-580}" python -m pytest tests/gpu -s ${GPU_K:+-k "$GPU_K"}
      cp "$OUT/gpu/summary.json" "$OUT/gpu_summary.json" 2>/dev/null
      tar czf "$OUT/gpu.tar.gz" -C "$OUT" gpu && rm -rf "$OUT/gpu" ;;
    # The 4-GPU tests of tests/gpu (the faults and the soak at TP=4, quant sites, the fused op, the first call).
    gpu4) GPU_K="four_gpus or (quant_sites and 4) or (matches_reference and 4) or (inside_reduce_overhead and 4)" \
        bash "$0" gpu ;;
    first2) stage first2 "${LIMIT:-150}" python -m pytest -q -s -x "$GPU_TESTS::test_first_fused_call_inside_reduce_overhead[2]" ;;
    first4) stage first4 "${LIMIT:-150}" python -m pytest -q -s -x "$GPU_TESTS::test_first_fused_call_inside_reduce_overhead[4]" ;;
    # Where only one GPU is lent (tests/gpu/shared_gpu.py: both ranks on GPU 0, gloo, what is computed,
    # not speed): the awkward inputs and soak through FlashInfer, two such jobs at once on the
    # one GPU (each its own IPC workspace), and the trained model with FlashInfer's exact kernels.
    bad1shared) stage bad1shared "${LIMIT:-240}" $TORCHRUN 2 tests/gpu/check_bad_inputs.py --shared-gpu \
      --out "$OUT/bad_inputs_shared_gpu" ;;
    soak1shared) SOAK_HANG_S=$(( ${LIMIT:-300} - 15 )) stage soak1shared "${LIMIT:-300}" $TORCHRUN 2 \
      tests/gpu/soak.py --shared-gpu --calls ${SOAK_CALLS:-2000} --out "$OUT/soak_shared_gpu" ;;
    jobs1shared)  # two independent 2-rank jobs on the one GPU at the same time
      for j in a b; do
        SOAK_HANG_S=$(( ${LIMIT:-240} - 15 )) stage "jobs1shared-$j" "${LIMIT:-240}" $TORCHRUN 2 --master-port \
          $([ $j = a ] && echo 29611 || echo 29612) tests/gpu/soak.py --shared-gpu --calls ${JOB_CALLS:-300} \
          --seed $([ $j = a ] && echo 1 || echo 2) --out "$OUT/soak_two_jobs_$j" > "$OUT/jobs1shared_$j.log" 2>&1 &
      done
      wait; tail -n 12 "$OUT"/jobs1shared_a.log "$OUT"/jobs1shared_b.log ;;
    fastar2)  # the fast-path all-reduce (not a site) through FlashInfer, eager and reduce-overhead, two GPUs
      stage fastar2 "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_fast_all_reduce.py --out "$OUT/fast_all_reduce" ;;
    fastar1shared) CHECK_HANG_S=$(( ${LIMIT:-300} - 15 )) stage fastar1shared "${LIMIT:-300}" $TORCHRUN 2 \
      tests/gpu/check_fast_all_reduce.py --shared-gpu --out "$OUT/fast_all_reduce_shared_gpu" ;;
    fallbackar2)  # the fused op's unfused all-reduce (of a copy) vs an all-reduce, and timed against one in place, two GPUs
      stage fallbackar2 "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_fallback_all_reduce.py --out "$OUT/fallback_all_reduce" ;;
    fallbackar1shared) CHECK_HANG_S=$(( ${LIMIT:-300} - 15 )) stage fallbackar1shared "${LIMIT:-300}" $TORCHRUN 2 \
      tests/gpu/check_fallback_all_reduce.py --shared-gpu --out "$OUT/fallback_all_reduce_shared_gpu" ;;
    faults1shared)  # the faults of docs/reliability.md with the real FlashInfer: a cache hit in fresh processes, a rank failing
      for c in ${FAULT_CASES:-cold warm fail_build low_memory}; do
        stage "faults1shared-$c" "${LIMIT:-240}" $TORCHRUN 2 tests/gpu/check_faults.py --shared-gpu --case $c \
          --cache /tmp/arfusion-fault-cache --out "$OUT/faults_shared_gpu"
      done ;;
    faults2)  # the same on two GPUs (NCCL); FAULT_CASES=fail_create for the handle-exchange timeout
      for c in ${FAULT_CASES:-cold warm fail_build low_memory}; do
        stage "faults2-$c" "${LIMIT:-240}" $TORCHRUN 2 tests/gpu/check_faults.py --case $c \
          --cache /tmp/arfusion-fault-cache2 --out "$OUT/faults"
      done ;;
    soak2+faults2)  # a 4-GPU host: the soak on GPUs 0,1 beside the faults on GPUs 2,3, waiting for both
      (CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 bash "$0" faults2 > "$OUT/faults2.log" 2>&1) &
      CUDA_VISIBLE_DEVICES=0,1 bash "$0" soak2
      wait
      grep -v "Warning" "$OUT/faults2.log" | tail -n 60 ;;
    loopfree1)  # LongCat-Flash's experts without their loop: numerics, whole-graph compile, CUDA graphs, time
      stage loopfree1 "${LIMIT:-300}" python tests/gpu/check_loop_free_experts.py --out "$OUT/loop_free" ;;
    loopfree1shared)  # the same model at TP=2 through the pass with FlashInfer (one GPU, two ranks)
      stage loopfree1shared "${LIMIT:-240}" $TORCHRUN 2 tests/gpu/check_loop_free_experts.py --shared-gpu \
        --out "$OUT/loop_free" ;;
    loopfree1sharedfin)  # the same with FlashInfer's MoE finalize kernel opted in (its two workspaces)
      stage loopfree1sharedfin "${LIMIT:-240}" env ARFUSION_FLASHINFER_MOE_FINALIZE=1 $TORCHRUN 2 \
        tests/gpu/check_loop_free_experts.py --shared-gpu --out "$OUT/loop_free_finalize" ;;
    acc1shared)  # after trainacc1 (or train1) wrote /tmp/ckpt-acc
      stage acc1shared "${LIMIT:-300}" $TORCHRUN 2 benchmarks/eval_accuracy.py --model /tmp/ckpt-acc --shared-gpu \
        --seqs ${SEQS:-32} --out "$OUT/acc_shared_gpu" --configs eager compiled arfusion_exact ;;
    train1) stage train1 "${LIMIT:-200}" python benchmarks/train_tiny_llama.py --out /tmp/ckpt-acc --steps ${STEPS:-800}
      cp /tmp/ckpt-acc/train_meta.json "$OUT/accuracy_gpu_train_meta.json" 2>/dev/null ;;
    plot) stage plot 30 python benchmarks/bench_fused_op.py --plot "$OUT"/bench_w2.json "$OUT"/bench_w4.json --png "$OUT/bench_fused_op.png" ;;
    # transformers' continuous batching with the pass (tests/gpu/check_continuous_batching.py): both
    # ranks on GPU 0 (shared) or one GPU each (2); with transformers' own CUDA graphs (graphs).
    cbshared) stage cbshared "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_continuous_batching.py --shared-gpu \
      --models "$CB_MODELS" --out "$OUT/cb_shared_tf$TF_TAG" ;;
    cbgraphsshared) stage cbgraphsshared "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_continuous_batching.py \
      --shared-gpu --cuda-graphs --models "$CB_MODELS" --out "$OUT/cb_shared_tf$TF_TAG" ;;
    cb2) stage cb2 "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_continuous_batching.py --two-gpus \
      --models "$CB_MODELS" --out "$OUT/cb_w2_tf$TF_TAG" ;;
    cbgraphs2) stage cbgraphs2 "${LIMIT:-300}" $TORCHRUN 2 tests/gpu/check_continuous_batching.py --two-gpus \
      --cuda-graphs --models "$CB_MODELS" --out "$OUT/cb_w2_tf$TF_TAG" ;;
    # Serving throughput (benchmarks/bench_serving.py): TP=2's host path on one GPU (fake2: off and on
    # calls alternate, a model each, 8 rounds: one H100's calls ran at two speeds 1.6x apart, in either
    # config, on 2026-12-07), both ranks on one GPU end to end (shared), two and four GPUs (serve2, serve4).
    servefake2) stage servefake2 "${LIMIT:-400}" python benchmarks/bench_serving.py --fake-world 2 --interleave --repeats 8 \
      --model-type "${SERVE_MODEL:-llama}" --layers "${SERVE_LAYERS:-8}" --out "$OUT/serving" ;;
    serveshared) stage serveshared "${LIMIT:-200}" $TORCHRUN 2 benchmarks/bench_serving.py --shared-gpu --tiny \
      --mixes 1,16 --prompt 64 --new 16 --repeats 1 --out "$OUT/serving" ;;
    serve2) stage serve2 "${LIMIT:-500}" $TORCHRUN 2 benchmarks/bench_serving.py --model-type "${SERVE_MODEL:-llama}" \
      ${SERVE_LAYERS:+--layers $SERVE_LAYERS} --out "$OUT/serving" ;;
    serve4) stage serve4 "${LIMIT:-500}" $TORCHRUN 4 benchmarks/bench_serving.py --model-type "${SERVE_MODEL:-llama}" \
      ${SERVE_LAYERS:+--layers $SERVE_LAYERS} --out "$OUT/serving" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
