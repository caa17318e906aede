"""Helpers the benchmarks share: what the fused op ran, the no-communication floor, errors, timing by
difference, saving, plots.

Timing inside CUDA graphs (`time_in_graph`) and the progress bar (`Progress`) are the package's
own (`arfusion.tuning`); import them from there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

# No NVLink multicast anywhere (NCCL NVLS, torch symmetric memory, NVSHMEM): as .device/setup.sh.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def no_multicast() -> None:
    """Set NO_MULTICAST before any communicator or symmetric buffer exists."""
    os.environ.update(NO_MULTICAST)


def log_arfusion_info() -> None:
    """arfusion's INFO lines (what the pass fused and declined, what ran unfused and why) on stderr,
    once: not again through a root handler set up later."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[arfusion] %(message)s"))
    log = logging.getLogger("arfusion")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


HOST_PATHS_NEED_FAKE_WORLD = "--flashinfer-host-path and --nccl-host-path stand in for peers: only with --fake-world"


def add_host_path_args(p: argparse.ArgumentParser) -> None:
    """--flashinfer-host-path and --nccl-host-path: with --fake-world, a TP rank's host path without its peers."""
    p.add_argument("--flashinfer-host-path", action="store_true",
                   help="with --fake-world on a GPU: the pass on FlashInfer, whose kernel call is skipped on a "
                        "stand-in workspace (flashinfer_host_path_only): the host path of TP=N's fused sites, "
                        "outputs wrong")
    p.add_argument("--nccl-host-path", action="store_true",
                   help="with --fake-world: every all-reduce (off's, and any the pass leaves) runs on a real "
                        "group of one rank (NCCL on a GPU, gloo on CPU), so that it costs the host what a real "
                        "rank's does (benchmarks/nccl_host_path.py); other collectives stay fake")


def rank0_print(rank: int) -> Callable[..., None]:
    """print (flushed) on rank 0, nothing elsewhere."""
    if rank != 0:
        return lambda *a, **k: None
    return lambda *a, **k: print(*a, **{"flush": True, **k})


def dispatch_since(before: dict) -> dict:
    """arfusion.stats()["dispatch"] counts added since `before` (an earlier arfusion.stats())."""
    import arfusion

    old = before["dispatch"]
    return {k: v - old.get(k, 0) for k, v in arfusion.stats()["dispatch"].items() if v != old.get(k, 0)}


# ----------------------------------------------------------------- the no-communication floor


class NoAllReduce(CustomGraphPass):
    """A post-grad pass for the decode step's floor: every all-reduce becomes its own input, so each
    rank keeps its partial sum (wrong numbers) and the step runs without that communication. The
    step's lower bound: (off - on) / (off - floor) is the share of the all-reduces' cost the pass
    removes. All-gathers (the LM head's) stay. `dropped` counts the all-reduces removed."""

    dropped = 0

    def __call__(self, graph) -> None:
        from arfusion.graph_utils import ALL_REDUCE, WAIT

        for node in list(graph.nodes):
            if node.target is WAIT and getattr(node.args[0], "target", None) is ALL_REDUCE:
                reduce = node.args[0]
                node.replace_all_uses_with(reduce.args[0])
                graph.erase_node(node)
                if not reduce.users:
                    graph.erase_node(reduce)
                NoAllReduce.dropped += 1

    def uuid(self) -> str:
        return "arfusion-bench-no-all-reduce-1"


def floor_options() -> dict:
    """torch.compile options that compile the floor (NoAllReduce as the post-grad pass)."""
    return {"post_grad_custom_post_pass": NoAllReduce()}


# ----------------------------------------------------------------- FlashInfer's host path, no peers


def flashinfer_host_path_only() -> None:
    """One process, no peers (--fake-world): arfusion's FlashInfer backend runs its whole host
    path (route, workspace check, output allocation, the kernel call's arguments) on a stand-in
    workspace and stops short of the kernel, whose outputs stay unwritten (numbers wrong). What a
    step costs the host with the pass on FlashInfer, without the peers FlashInfer needs. The
    kernel call's own host time (~10 us on an H200 host, docs/history/2026-11-29-matrix-fourteenth-stage.md)
    is left out."""
    import types

    from arfusion.backends import flashinfer_kernel
    from arfusion.backends.flashinfer import FlashInferBackend

    def stand_in(self, call, max_tokens):
        return types.SimpleNamespace(
            world_size=call.world_size, rank=0, workspace_tensor=torch.zeros(3, dtype=torch.int64),
            metadata={"max_token_num": max_tokens, "tp_size": call.world_size, "hidden_dim": call.hidden},
            is_buffer_size_sufficient=lambda tp, tokens, hidden, dtype, *rest: tokens * hidden <= max_tokens * hidden,
            destroy=lambda: None), None

    FlashInferBackend._new_workspace = stand_in
    flashinfer_kernel.kernel_call = lambda fic: (lambda **arguments: None)


def _cpus(cpulist: str) -> list[int]:
    """'0-3,8,10-11' (sysfs cpulist) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in cpulist.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def gpu_numa_node(device_index: int, sysfs: str = "/sys") -> int | None:
    """The NUMA node the GPU hangs off (sysfs, by its PCI address), or None where unknown."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    if not hasattr(props, "pci_bus_id"):
        return None
    address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        node = int(Path(sysfs, "bus/pci/devices", address, "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def numa_placement(device_index: int = 0, pin: bool = False, sysfs: str = "/sys") -> dict:
    """The host's NUMA nodes (CPUs each), the GPU's node, this process's CPUs. With `pin`, the
    process first moves to the GPU's node's CPUs, so that what it allocates afterwards is local
    (Linux places a page on the node that first touches it) and both configs of a run share one
    placement. Machine V (2026-11-29) raised it as a cause of one config's slower host calls;
    machine W's host had one node, and the cause was elsewhere (docs/history/2026-11-29-default-
    mode-stand-in.md). The record stays: a host with several nodes can still place a run badly."""
    nodes = {int(d.name[4:]): _cpus((d / "cpulist").read_text())
             for d in sorted(Path(sysfs, "devices/system/node").glob("node[0-9]*"))}
    gpu_node = gpu_numa_node(device_index, sysfs)
    placement = {"nodes": {str(n): len(c) for n, c in nodes.items()}, "gpu_node": gpu_node, "pinned": False}
    if pin and gpu_node in nodes and len(nodes) > 1:
        os.sched_setaffinity(0, nodes[gpu_node])
        placement["pinned"] = True
    placement["cpus"] = len(os.sched_getaffinity(0))
    return placement


# ----------------------------------------------------------------- errors


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of the whole tensor, in fp32."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def rel_err_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each row (over the last dim: a position's logits), in fp32."""
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def top1_same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """1.0 where both rows' argmax agree, else 0.0 (per row of the last dim)."""
    return (got.argmax(-1) == want.argmax(-1)).float()


# ----------------------------------------------------------------- timing


def sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], object], device=None) -> float:
    """Wall milliseconds of one fn() call, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def by_difference(long_n: int, long_value: float, short_n: int, short_value: float) -> tuple[float, float]:
    """(per token, fixed per call) from one quantity measured for two lengths of the same call:
    the slope long - short over the tokens between them, and what is left of the short call.
    A whole call divided by its tokens mixes the two (prefill, cache set-up, compile checks)."""
    per_token = (long_value - short_value) / (long_n - short_n)
    return per_token, short_value - short_n * per_token


def per_token_counts(long_n: int, long_counts: dict, short_n: int, short_counts: dict) -> dict:
    """{name: {"per_token", "per_call"}} for counts (kernels, graph launches, replays) taken over
    one call at each of two lengths: per new token by difference, and the fixed rest per call."""
    out = {}
    for key in sorted(set(long_counts) | set(short_counts)):
        per_token, fixed = by_difference(long_n, long_counts.get(key, 0), short_n, short_counts.get(key, 0))
        out[key] = {"per_token": round(per_token, 3), "per_call": round(fixed, 3)}
    return out


# ----------------------------------------------------------------- results


def save_json(path: str, obj) -> str:
    """Write obj as indented JSON (folders made as needed); returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def rounded(row: dict, digits: int = 2) -> dict:
    """A row with its floats rounded, for one-line progress prints."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in row.items()}


def pyplot():
    """matplotlib.pyplot drawing off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png: str) -> None:
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
