#!/usr/bin/env bash
# Once, on the CPU machine, from the project root: stage Flash Attention 3's kernels for the GPU
# machines (no network there). vLLM 0.25.1's wheel is built for torch 2.11 and CUDA 13, as those
# machines are; its `vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so` (153 MB) holds FA3 for SM90. Only
# that file is kept, xz-compressed (8 MB), in .fa3/ (git-ignored): carry ".fa3" with ".device".
# On the machine: source benchmarks/device/fa3_setup.sh (after .device/setup.sh).
set -euo pipefail
VLLM=${VLLM:-0.25.1}
SO=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download -q --no-deps "vllm==$VLLM" -d "$tmp"
unzip -q -o "$tmp"/vllm-*.whl "$SO" -d "$tmp"
mkdir -p .fa3
xz -9 -T0 -c "$tmp/$SO" > .fa3/_vllm_fa3_C.abi3.so.xz
echo "vllm==$VLLM $(sha256sum "$tmp/$SO" | cut -c1-16)" > .fa3/SOURCE
ls -la .fa3
