"""FlashInfer's quantized all-reduce (`flashinfer.comm.quantized_allreduce`, FP8 payload, two-shot
over torch symmetric memory) for the opt-in lossy path of the fused op. Mixed into
`FlashInferBackend`."""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import runtime
from ..decisions import Reason, Why
from ..core import Call
from ..runtime import all_ranks_agree, comm_device, outside_graph_pools
from . import flashinfer_dispatch as dispatch, flashinfer_exchange as exchange
from .base import over_cap

log = logging.getLogger("arfusion")
WORLD_SIZES = frozenset({2, 4, 8, 16})


@dataclass
class CodecState:
    """The quantized all-reduce on one process group."""

    ready: bool = False  # FlashInfer's symmetric buffer exists at full size
    failed: str | None = None  # set on every rank at once; exact all-reduce from then on


class QuantizedAllReduce:
    """The quantized half of the FlashInfer backend (needs its `facts`, `_codecs`)."""

    def codec_min_bytes(self, call: Call, level: str) -> tuple[int | None, str]:
        facts = self.facts(call)
        return dispatch.codec_min_bytes(facts.sm[0], facts.name, call.world_size, call.hidden, call.dtype,
                                            level)

    def codec_problem(self, call: Call, level: str) -> Reason | None:
        """flashinfer.comm.quantized_allreduce's own limits (0.7.2.post1)."""
        if call.dtype != torch.bfloat16:
            return Reason(Why.DTYPE, f"FlashInfer's quantized all-reduce takes bfloat16 only, not {call.dtype}")
        if call.world_size not in WORLD_SIZES:  # its stripe (4096) must split evenly: 2, 4, 8, 16
            return Reason(Why.WORLD_SIZE, "FlashInfer's quantized all-reduce needs a power-of-two world size <= 16, "
                                          f"not {call.world_size}")
        if call.hidden % 8:
            return Reason(Why.SHAPE, f"hidden size {call.hidden} is not a multiple of 8")
        if self.facts(call).sm[0] < 9:
            return Reason(Why.GPU_ARCH, "FlashInfer's quantized all-reduce needs SM90+ (FP8)")
        return over_cap(call, dispatch.QUANTIZED_MAX_BYTES, "largest size measured")

    def prepare_codec(self, call: Call, level: str) -> Reason | None:
        reason = self._quantized_buffer(call)
        return Reason(Why.RUNTIME, reason) if reason else None

    def _quantized_buffer(self, call: Call) -> str | None:
        state = self._codecs.current(call.group_name)
        if state.failed or state.ready:
            return state.failed
        if runtime.capturing():
            return ("the quantized all-reduce's buffer is never created during CUDA-graph capture: run "
                    "the model once eagerly first")
        return outside_graph_pools(call.device, lambda: self._create_quantized_buffer(state, call))

    def _create_quantized_buffer(self, state, call: Call) -> str | None:
        """Collective over the call's group. FlashInfer allocates its symmetric buffer at the first
        call and again whenever a larger message comes; one warm-up call at the largest size this
        backend quantizes makes it once, here, outside CUDA-graph pools, and builds the kernel."""
        group = dist.distributed_c10d._resolve_process_group(call.group_name)
        comm_dev = comm_device(group, call.device)
        started = time.perf_counter()
        problem = None
        try:
            module = importlib.import_module("flashinfer.comm.quantized_allreduce")
        except Exception as e:
            problem = f"flashinfer.comm.quantized_allreduce unavailable: {type(e).__name__}: {e}"
        if not all_ranks_agree(problem is None, group, comm_dev):
            state.failed = problem or "the quantized all-reduce is unavailable on another rank"
            return state.failed
        try:
            warm = torch.zeros(dispatch.QUANTIZED_MAX_BYTES // 2, dtype=torch.bfloat16, device=call.device)
            with exchange.unicast_symmetric_memory():  # its one symmetric buffer is made here
                module.quantized_all_reduce(warm, group, output=torch.empty_like(warm))
            del warm
        except Exception as e:  # e.g. no symmetric memory (no NVSwitch / P2P): every rank learns below
            problem = f"FlashInfer quantized all-reduce set-up failed: {type(e).__name__}: {e}"
        if not all_ranks_agree(problem is None, group, comm_dev):
            state.failed = problem or "FlashInfer quantized all-reduce set-up failed on another rank"
            return state.failed
        state.ready = True
        knobs = "no CUDA device"  # a stand-in module on CPU (tests)
        if call.device.type == "cuda":
            facts = self.facts(call)
            knobs = dispatch.codec_knobs_text(facts.sm[0], facts.name, group.size(), call.hidden, call.dtype)
        log.info("arfusion: FlashInfer quantized all-reduce for group %s (world %d) ready in %.1fs (buffer for "
                 "%.0f MiB per rank; %s)", call.group_name, group.size(), time.perf_counter() - started,
                 dispatch.QUANTIZED_MAX_BYTES / dispatch.MiB, knobs)
        return None

    def codec_all_reduce(self, call: Call, x: torch.Tensor, level: str) -> torch.Tensor:
        # Triton specialises the kernel per message size: the first call at a new size compiles
        # it (eager warm-up, as cudagraph trees and torch.compile do before capturing).
        module = importlib.import_module("flashinfer.comm.quantized_allreduce")
        facts = self.facts(call)
        knobs = dispatch.codec_knobs(facts.sm[0], facts.name, call.world_size, call.hidden, call.dtype,
                                     x.numel() * x.element_size(), level)
        return module.quantized_all_reduce(x, dist.distributed_c10d._resolve_process_group(call.group_name), **knobs)
