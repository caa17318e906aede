"""The fused op's run-time fallback: compiled on GPUs, eager reference elsewhere (CPU, gloo)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch._dynamo.utils import counters

import arfusion.ops  # noqa: F401  (registers torch.ops.arfusion.*)
from arfusion import execution, reference, runtime
from arfusion.backends.base import tables_changed
from arfusion.core import Form
from arfusion.policy import Caps
from .helpers import run_workers

SITE = Form(residual=True, norm="rms", quant="fp8_dynamic", emit_norm=True)


def declined_call(group_name, x, res, w):
    # backend "flashinfer" on a CPU tensor: declined at run time, so the op computes the fallback
    return torch.ops.arfusion.fused_allreduce_rmsnorm(
        x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=group_name, norm=SITE.norm,
        quant=SITE.quant, quant_scale=None, emit_norm=SITE.emit_norm, backend="flashinfer")


def inputs():
    torch.manual_seed(0)
    return (torch.randn(5, 256, dtype=torch.bfloat16), torch.randn(5, 256, dtype=torch.bfloat16),
            (1 + 0.1 * torch.randn(256)).to(torch.bfloat16))


def test_cpu_fallback_is_the_eager_reference(world_of_one, monkeypatch):
    monkeypatch.setattr(execution, "compiled", lambda fn: pytest.fail("compiled on CPU"))
    x, res, w = inputs()
    got = declined_call(world_of_one, x, res, w)
    want = reference.unfused(x, res, w, 1e-6, world_of_one, SITE)
    assert len(got) == len(want) and all(torch.equal(g.float(), r.float()) for g, r in zip(got, want))
    assert arfusion.stats()["dispatch"] == {"fallback": 1}


def test_gpu_fallback_is_all_reduce_plus_compiled_norm(world_of_one, monkeypatch):
    monkeypatch.setattr(execution, "compiles_fallback", lambda device: True)  # as on CUDA
    used, real = [], execution.compiled
    monkeypatch.setattr(execution, "compiled", lambda fn: used.append(fn) or real(fn))
    reduced = []
    real_ar = execution.all_reduce_on_current_stream  # blocking dist.all_reduce: NCCL on the caller's stream
    monkeypatch.setattr(execution, "all_reduce_on_current_stream",
                        lambda x, g, on_x=False: reduced.append(g) or real_ar(x, g, on_x))
    x, res, w = inputs()
    want = reference.unfused(x, res, w, 1e-6, world_of_one, SITE)
    monkeypatch.setattr(reference, "all_reduce_sum", lambda x, g: pytest.fail("functional all_reduce used"))
    got = declined_call(world_of_one, x, res, w)
    assert used == [reference.add_rms_norm] and reduced == [world_of_one]
    assert [t.shape for t in got] == [t.shape for t in want]
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1].float(), want[1].float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(got[3], want[3], rtol=1e-2)


def _sums_without_touching_the_input(rank):
    """On each rank: x, dense or strided, is summed over the group into a new dense tensor by one
    all-reduce (of a copy); x is left as it was. Where the caller lets it overwrite x, a dense x
    is summed in place, a strided one as before."""
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    collectives = []
    real_ar = dist.all_reduce
    dist.all_reduce = lambda *a, **k: collectives.append("ar") or real_ar(*a, **k)
    try:
        for x in (torch.arange(24.0).reshape(4, 6) + 100 * rank,
                  (torch.arange(24.0).reshape(4, 6) + 100 * rank).t()):  # strided
            before = x.clone()
            collectives.clear()
            got = execution.all_reduce_on_current_stream(x, group)
            want = 2 * (before - 100 * rank) + 100  # x0 + x1
            assert torch.equal(got, want) and got.is_contiguous() and collectives == ["ar"], collectives
            assert torch.equal(x, before)
            collectives.clear()
            got = execution.all_reduce_on_current_stream(x, group, x_is_scratch=True)
            assert torch.equal(got, want) and collectives == ["ar"]
            assert (got is x) == x.is_contiguous() and torch.equal(x, want if x.is_contiguous() else before)
    finally:
        dist.all_reduce = real_ar


@pytest.mark.multiproc
def test_the_unfused_all_reduce_leaves_its_input():
    run_workers(_sums_without_touching_the_input, 2)


def _norm_only(h):  # a function of its own: `compiled` caches per function
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_never_compiles_during_capture(monkeypatch):
    counters.clear()
    fast = runtime.compiled(_norm_only)
    h = torch.randn(4, 64)
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert torch.allclose(fast(h), _norm_only(h))  # capturing, nothing compiled yet: eager
    assert counters["stats"]["unique_graphs"] == 0
    monkeypatch.setattr(runtime, "capturing", lambda: False)
    fast(h)  # the first eager call compiles
    assert counters["stats"]["unique_graphs"] == 1
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    h7 = torch.randn(7, 64)
    assert torch.allclose(fast(h7), _norm_only(h7), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # dynamic shapes: no new graph in the capture
    fast(torch.randn(7, 64, dtype=torch.float64))  # would need a recompile: runs eagerly instead
    assert counters["stats"]["unique_graphs"] == 1
    assert arfusion.stats()["eager_in_cuda_graphs"] == {"_norm_only": 2}  # the first call and this one


def _norm_with_weight(h, w):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_a_capture_under_inference_mode_runs_what_no_grad_compiled(monkeypatch, caplog):
    """transformers' serving loop warms up under no_grad and captures later steps' CUDA graphs in its
    own thread under inference mode: there activations are inference tensors and the weights are
    not. Their dispatch keys differed from what the first compile saw, so Dynamo's guards failed,
    and a capture, which cannot compile, ran the norm eagerly at every replay (machine X). Now the
    compiled code passes its guards there, under grad mode too; a real mismatch (a new dtype) still
    runs eagerly, counted and logged with Dynamo's reason."""
    counters.clear()
    fast = runtime.compiled(_norm_with_weight)
    w = torch.nn.Parameter(torch.rand(64) + 0.5, requires_grad=False)
    with torch.no_grad():
        fast(torch.randn(4, 64), w)
    assert counters["stats"]["unique_graphs"] == 1
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    got = {}

    def serving_thread():
        with torch.inference_mode():
            h = torch.randn(9, 64)
            got["inference"] = (fast(h, w), _norm_with_weight(h, w))

    worker = threading.Thread(target=serving_thread)
    worker.start()
    worker.join()
    h = torch.randn(5, 64)
    got["grad mode"] = (fast(h, w), _norm_with_weight(h, w))
    for name, (out, want) in got.items():
        assert torch.allclose(out, want, atol=1e-5), name
    assert got["inference"][0].is_inference()  # as the eager function would make it there
    assert counters["stats"]["unique_graphs"] == 1 and arfusion.stats()["eager_in_cuda_graphs"] == {}
    with caplog.at_level(logging.INFO, logger="arfusion"):
        h = torch.randn(5, 64, dtype=torch.float64)
        assert torch.allclose(fast(h, w.double()), _norm_with_weight(h, w.double()))
    assert counters["stats"]["unique_graphs"] == 1
    assert arfusion.stats()["eager_in_cuda_graphs"] == {"_norm_with_weight": 1}
    assert "_norm_with_weight ran eagerly inside a CUDA-graph capture" in caplog.text
    assert "dtype mismatch" in caplog.text  # Dynamo's own reason


def test_a_failing_compile_falls_back_to_eager(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("no triton")

    def _double(h):
        return 2 * h

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: boom)
    fast = runtime.compiled(_double)
    assert torch.equal(fast(torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])  # flashinfer: declined on CPU, the fallback runs
@pytest.mark.parametrize("quant", ["none", "fp8_dynamic"])
def test_outputs_are_dense_whatever_the_input_layout(world_of_one, backend, quant):
    """Kernels write dense [T, H] buffers, so the op's fake must promise dense outputs and every
    path must deliver them. Found on a GPU (tests/gpu/check_bad_inputs.py, FlashInfer): an
    all-reduce input that is every other column of a wider buffer and a transposed residual made
    the fake say "transposed" (the reference math follows the residual's layout) while FlashInfer
    returned a dense sum, and the compiled graph's stride check raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    wide, tall = torch.randn(5, 512, dtype=torch.bfloat16), torch.randn(256, 5, dtype=torch.bfloat16)
    x, res, w = wide[:, ::2], tall.t(), (1 + 0.1 * torch.randn(256)).to(torch.bfloat16)

    def call(x, res, w):
        return torch.ops.arfusion.fused_allreduce_rmsnorm(
            x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=world_of_one, norm="rms",
            quant=quant, quant_scale=None, emit_norm=True, backend=backend)

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = call(mode.from_tensor(x), mode.from_tensor(res), mode.from_tensor(w))
    real = call(x, res, w)
    for f, r in zip(fake, real):
        assert f.is_contiguous() and r.is_contiguous(), (f.stride(), r.stride())
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)
    want = reference.unfused(x, res, w, 1e-6, world_of_one, Form(residual=True, norm="rms", quant=quant,
                                                                    emit_norm=True))
    assert torch.equal(real[0], want[0]) and torch.equal(real[1].float(), want[1].float())


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])  # a backend's run / the declined fallback
def test_input_scale_is_applied_on_every_path(world_of_one, backend):
    """f * AR(x) sites (Granite): the op scales x before a backend's kernel, the all-reduced value
    on the unfused path; one rank, so both are round(f * x)."""
    import arfusion

    arfusion.reset_stats()
    x, res, w = inputs()
    got = torch.ops.arfusion.fused_allreduce_rmsnorm(
        x=x, residual=res, weight=w, eps=1e-6, eps_tensor=None, group_name=world_of_one, norm=SITE.norm,
        quant=SITE.quant, quant_scale=None, emit_norm=SITE.emit_norm, backend=backend, input_scale=0.22)
    want = reference.add_rms_norm(x, res, w, 1e-6, SITE, None, 0.22)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert arfusion.stats()["dispatch"] == ({"torch": 1} if backend == "torch" else {"fallback": 1})


class _GpuScalar:
    """Stands in for a 0-d GPU tensor: counts the reads (each one a synchronisation on a GPU)."""

    device = torch.device("cuda")

    def __init__(self, value):
        self.value, self._version, self.reads = value, 0, 0

    def __float__(self):
        self.reads += 1
        return self.value


def test_an_eps_buffer_is_read_once_per_version_and_never_inside_a_capture(monkeypatch):
    eps = _GpuScalar(1e-6)
    assert runtime.scalar_value(eps) == 1e-6 and runtime.scalar_value(eps) == 1e-6
    assert eps.reads == 1  # cached: no synchronisation per call
    eps._version += 1  # written in place
    assert runtime.scalar_value(eps) == 1e-6 and eps.reads == 2
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert runtime.scalar_value(eps) == 1e-6 and eps.reads == 2  # read before: the capture uses the value
    fresh = _GpuScalar(1e-5)
    assert runtime.scalar_value(fresh) is None and fresh.reads == 0  # never read: no sync inside a capture
    cpu = torch.tensor(3e-4, dtype=torch.float64)
    assert runtime.scalar_value(cpu) == 3e-4


def test_an_unread_gpu_eps_during_capture_runs_unfused_with_the_tensor(world_of_one):
    x, res, w = inputs()
    eps = torch.tensor(1e-6)
    got = execution.run_fused(x, res, w, eps, world_of_one, SITE, quant_scale=None, backend="torch",
                              caps=Caps())  # eps as the tensor
    want = reference.unfused(x, res, w, 1e-6, world_of_one, SITE)
    assert all(torch.allclose(g.float(), r.float(), atol=1e-2) for g, r in zip(got, want))
    assert arfusion.stats()["dispatch"] == {"fallback": 1}


def test_a_negative_cap_is_an_error_not_a_cap(world_of_one):
    """None means the backend's own size table; -1 (an old spelling of it) is refused, not read
    as a cap that declines every call."""
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="not -1"):
        torch.ops.arfusion.all_reduce(x=x, group_name=world_of_one, backend="torch", max_bytes=-1)
    with pytest.raises(ValueError, match="not -1"):
        torch.ops.arfusion.fused_allreduce_rmsnorm(
            x=x, residual=None, weight=None, eps=1e-6, eps_tensor=None, group_name=world_of_one, norm="rms",
            quant="none", quant_scale=None, emit_norm=True, backend="torch", max_bytes=-1)


def test_each_call_signature_is_routed_once(world_of_one, monkeypatch):
    """Outside CUDA-graph replays every site pays its run-time route on every step: it is asked
    once per call signature, looked up after, and asked again when the tables change."""
    asked = []
    real_route = execution.route
    monkeypatch.setattr(execution, "route", lambda backend, call, *rest: asked.append(call.tokens)
                        or real_route(backend, call, *rest))
    x, res, w = inputs()

    def run(tokens, caps=Caps()):
        return execution.run_fused(x[:tokens], res[:tokens], w, 1e-6, world_of_one, SITE, quant_scale=None,
                                   backend="torch", caps=caps)

    first = run(5)
    assert all(torch.equal(a, b) for a, b in zip(first, run(5))) and asked == [5]
    run(3)
    run(5, Caps(fused=0))  # another cap: another route (this one declines)
    assert asked == [5, 3, 5]
    assert arfusion.stats()["dispatch"] == {"torch": 3, "fallback": 1}
    tables_changed()
    run(5)
    assert asked == [5, 3, 5, 5]


def test_plain_and_moe_calls_are_routed_once_per_signature(world_of_one, monkeypatch):
    """The plain fast all-reduce and the MoE combine op remember their routes as the fused op does
    (their refusals read the backend's tables, a tuned cache's path among them)."""
    asked = []
    for name in ("plain_refusal", "moe_combine_refusal"):
        real = getattr(execution, name)
        monkeypatch.setattr(execution, name, lambda backend, call, *rest, real=real, name=name:
                            asked.append((name, call.tokens)) or real(backend, call, *rest))
    x, _, w = inputs()
    for tokens in (5, 5, 3, 5):
        got = execution.run_all_reduce(x[:tokens], world_of_one, "torch", Caps())
        assert torch.equal(got, x[:tokens])  # a world of one
    assert asked == [("plain_refusal", 5), ("plain_refusal", 3)]
    torch.manual_seed(1)
    rows, scale, index = torch.randn(8, 256, dtype=torch.bfloat16), torch.rand(8, 1, dtype=torch.bfloat16), torch.randperm(8)
    form = Form(residual=True, norm="rms")
    for _ in range(2):
        got = execution.run_moe_combine(rows, scale, index, 2, True, x[:4], w, 1e-6, world_of_one, form, None,
                                        "torch", Caps())
        want = reference.unfused(reference.moe_combine(rows, scale, index, 2, True), x[:4], w, 1e-6, world_of_one, form)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert asked[2:] == [("moe_combine_refusal", 4)]
    tables_changed()
    execution.run_all_reduce(x, world_of_one, "torch", Caps())
    assert asked[3:] == [("plain_refusal", 5)]


def test_a_codec_route_never_binds_the_exact_kernel(world_of_one, monkeypatch):
    """A call routed to the quantized all-reduce runs the exact kernel where the codec is not
    ready this once (e.g. inside a capture); that must not make the kernel's bound call the
    signature's answer from then on."""
    from arfusion.backends import get_backend
    from arfusion.decisions import Reason, Why

    backend = get_backend("torch")
    bound, declines = [], [Reason(Why.RUNTIME, "not ready this once")]
    monkeypatch.setattr(backend, "bind", lambda call: bound.append(call) or (lambda *a: pytest.fail("bound")))
    monkeypatch.setattr(backend, "prepare_codec", lambda call, level: declines.pop() if declines else None)
    x, res, w = inputs()
    site = Form(residual=True, norm="rms")
    for _ in range(2):
        execution.run_fused(x, res, w, 1e-6, world_of_one, site, None, "torch", Caps(codec_min=0), codec="fp8")
    assert bound == [] and arfusion.stats()["dispatch"] == {"torch": 1, "torch quantized fp8": 1}
    execution.run_fused(x, res, w, 1e-6, world_of_one, site, None, "torch", Caps())  # the exact route binds
    assert len(bound) == 1
