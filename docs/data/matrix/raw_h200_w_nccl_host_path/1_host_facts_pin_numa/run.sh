#!/usr/bin/env bash
# scratch (not committed): machine facts, then the 24-layer MoE stand-in unpinned and pinned
set -u
pip install -q --no-deps --no-compile --target /tmp/tf524 .whl/transformers-5.24.0-py3-none-any.whl
export PYTHONPATH=/tmp/tf524:$PYTHONPATH
{
  echo "== lscpu"; lscpu
  echo "== nodes"; for d in /sys/devices/system/node/node*; do echo "$d $(cat $d/cpulist)"; done
  echo "== affinity"; python -c "import os; print(sorted(os.sched_getaffinity(0)))"
  echo "== cgroup"; cat /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpuset.cpus.effective /sys/fs/cgroup/cpuset.mems.effective 2>&1; cat /sys/fs/cgroup/cpu.stat 2>&1
  echo "== topo"; nvidia-smi topo -m
  echo "== smt"; cat /sys/devices/system/cpu/smt/active 2>&1; for c in 0 1 2 3; do echo "cpu$c siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>&1)"; done
  echo "== load"; cat /proc/loadavg; uptime
  echo "== gpu numa"; python -c "
import sys; sys.path.insert(0,'benchmarks')
import common; print(common.numa_placement(0))"
  echo "== thp"; cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1
  echo "== governor"; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1; grep MHz /proc/cpuinfo | head -16
} > $OUT/machine.txt 2>&1
CMD="python benchmarks/bench_hf_decode.py --fake-world 2 --flashinfer-host-path --phases generate --generate-mode default --gen-variants greedy:1 --pairs 6 --lengths 72 8 --model-type qwen3_moe --layers 24 --unique-layers 4 --budget-s 200"
for run in ${RUNS:-a b}; do
  extra=""; [ "$run" = b ] && extra="--pin-numa"
  cat /sys/fs/cgroup/cpu.stat > $OUT/cpustat_${run}_before.txt 2>&1
  echo "=== $run $extra"; start=$SECONDS
  timeout -k 10 ${LIMIT:-230} $CMD $extra --out $OUT/$run > $OUT/$run.log 2>&1
  echo "=== $run rc=$? $((SECONDS-start))s"; tail -4 $OUT/$run.log
  cat /sys/fs/cgroup/cpu.stat > $OUT/cpustat_${run}_after.txt 2>&1
done
