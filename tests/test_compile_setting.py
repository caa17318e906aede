"""arfusion.hf.same_compile_setting_in_every_thread: a graph compiled in one thread serves another.

torch 2.15's `DeviceMesh.get_group` and `dist.all_reduce` read the per-thread setting
`torch.compiler.config.compile_on_one_rank` where Dynamo traces transformers' TP hooks, and Dynamo
guards its stored value. Inductor's pattern matcher leaves False stored in the thread that compiled;
a new thread stores nothing. Continuous batching compiles in the caller's thread and runs in a
generation thread of its own: each graph was compiled twice (tests/test_continuous_batching.py).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch._inductor.pattern_matcher import fwd_only
from torch.distributed.device_mesh import init_device_mesh

from arfusion import hf
from arfusion.testing import fake_world


def test_a_graph_compiled_in_one_thread_is_not_compiled_again_in_another():
    """transformers' TP hook as it reaches Dynamo (the mesh's group, an in-place all-reduce),
    compiled here by a backend that traces a pattern as Inductor's pattern matcher does, then called
    from a new thread as continuous batching's generation thread calls it: one graph, not two."""
    assert hf.same_compile_setting_in_every_thread()[0] == hasattr(torch.compiler.config, "compile_on_one_rank")
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        fwd_only(lambda x: x + 1, [torch.ones(2)])  # what Inductor's replacements do while compiling
        return gm

    def tp_output_hook(x, mesh):
        dist.all_reduce(x, group=mesh.get_group())
        return x * 2

    with fake_world(2), torch.no_grad():
        mesh = init_device_mesh("cpu", (2,))
        torch._dynamo.reset()
        compiled = torch.compile(tp_output_hook, backend=backend, fullgraph=True)
        compiled(torch.ones(4), mesh)
        compiled(torch.ones(4), mesh)  # this thread again
        elsewhere = threading.Thread(target=torch.no_grad()(compiled), args=(torch.ones(4), mesh))  # grad mode is per thread
        elsewhere.start()
        elsewhere.join()
        torch._dynamo.reset()
    assert len(graphs) == 1
