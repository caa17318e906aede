# Source on a GPU machine after .device/setup.sh, with .fa3 carried (benchmarks/device/stage_fa3.sh):
# unpacks vLLM's FA3 kernels to /tmp/fa3 and puts benchmarks/flash_attn3 (Flash Attention 3's
# interface over them, with the flash_attn_3 dist-info transformers checks) on PYTHONPATH.
# Then `bench_serving.py --attn flash_attention_3` takes transformers' decode fast path.
if [ ! -f /tmp/fa3/_vllm_fa3_C.abi3.so ]; then
  mkdir -p /tmp/fa3 && xz -d -c .fa3/_vllm_fa3_C.abi3.so.xz > /tmp/fa3/_vllm_fa3_C.abi3.so
fi
export ARFUSION_FA3_SO=/tmp/fa3/_vllm_fa3_C.abi3.so
export PYTHONPATH="$PWD/benchmarks/flash_attn3:${PYTHONPATH:-}"
