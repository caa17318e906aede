"""The aiter backend's decisions, fallback chain, detection and aiter argument contract, on CPU.

This verifies arfusion's side only: which aiter call is made, with which arguments, and what
is done with the result. aiter itself is replaced by tests/fake_aiter.py, a stand-in written
from aiter's documented signatures (0.1.7, an intermediate commit, and main) that computes
with arfusion's reference math. Nothing here has run on ROCm hardware or any aiter kernel.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.abc
import importlib.machinery
import logging
import sys
import types

import pytest
import torch
import torch.distributed as dist

import arfusion.ops
from arfusion import quant, reference, runtime
from arfusion.backends.aiter import AiterBackend, communicator, detection, limits, stages
from arfusion.backends import get_backend, resolve
from arfusion.core import PLAIN, Call
from arfusion.decisions import Why

from .fake_aiter import CUDA, GROUP, V017, V_MAIN, V_STAGE, FakeAiter, call, fake_quantize, simulate_rocm
from .helpers import collect_from_ranks

KIB, MIB = 1024, 1024 * 1024
BF16 = torch.bfloat16


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def clean_state():
    detection.detect.cache_clear()
    stages._reference_layout.cache_clear()
    communicator._gloo_groups.clear()
    arfusion.runtime._logged.clear()
    yield
    detection.detect.cache_clear()
    stages._reference_layout.cache_clear()


class _BlockAiterImports(importlib.abc.MetaPathFinder):
    """Fails any attempt to import aiter (or what its failed import leaves behind)."""

    def __init__(self, error=ImportError):
        self.error = error
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "aiter":
            self.attempts.append(name)
            raise self.error(f"blocked import of {name}")
        return None


def _aiter_modules() -> list[str]:
    """aiter, or the generic modules its failed import leaves behind: aiter/jit/core.py puts
    aiter/jit/utils on sys.path first (amd-aiter 0.1.7.post2.dev18)."""
    left_behind = ("aiter", "chip_info", "cpp_extension", "torch_guard", "file_baton")
    return [m for m in sys.modules if m.split(".")[0] in left_behind]


@pytest.fixture
def block_aiter(monkeypatch):
    assert _aiter_modules() == []  # `import arfusion` (at collection) loaded none of it
    blocker = _BlockAiterImports()
    monkeypatch.setattr(sys, "meta_path", [blocker, *sys.meta_path])
    return blocker


@pytest.fixture
def rocm_env(monkeypatch):
    """simulate_rocm plus a fake all-reduce and reference quant, so runs compute on the CPU."""

    def setup(arch="gfx950", version=V_MAIN, **fake_kwargs):
        fake = FakeAiter(version=version, fp8=limits.LIMITS.fp8_dtypes[arch], **fake_kwargs)
        simulate_rocm(monkeypatch, arch, fake)
        monkeypatch.setattr(reference, "all_reduce_sum", lambda x, group: fake.reduce(x))
        monkeypatch.setattr(quant, "quantize",
                            lambda normed, form, scale: fake_quantize(normed, form, scale, fake.fp8))
        monkeypatch.setattr(communicator, "resolve", lambda name: f"pg:{name}")
        monkeypatch.setattr(communicator, "gloo_twin", lambda group: f"gloo:{group}")
        monkeypatch.setattr(runtime, "capturing", lambda: False)
        return fake

    return setup


def inputs(c: Call, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c.tokens, c.hidden, generator=g).to(c.dtype)
    residual = torch.randn(c.tokens, c.hidden, generator=g).to(c.dtype) if c.form.residual else None
    weight = (1 + 0.1 * torch.randn(c.hidden, generator=g)).to(c.weight_dtype)
    scale = torch.tensor(0.05) if c.form.quant == "fp8_static" else None
    return x, residual, weight, 1e-6, scale


def run_and_expect(backend, c: Call, seed=0):
    """Run the backend; assert its outputs equal the unfused reference, name by name."""
    x, residual, weight, eps, scale = inputs(c, seed)
    outs = backend.run(c, x, residual, weight, eps, scale)
    expected = reference.unfused(x, residual, weight, eps, GROUP, c.form, scale)
    assert len(outs) == len(c.form.outputs())
    for name, got, want in zip(c.form.outputs(), outs, expected):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.float(), want.float()), name
    return outs


def found_for(arch="gfx950", version=V_MAIN, fp8=None) -> detection.Detected:
    fake = FakeAiter(version=version, fp8=fp8 or limits.LIMITS.fp8_dtypes[arch])
    mod = fake.modules()[limits.CUSTOM_AR_MODULE]
    return detection.Detected(arch=arch, api=detection.describe_api(mod, version, fake.fp8), custom_ar=mod)


# ---------------------------------------------------------------- detection


def test_this_machine_never_imports_aiter(block_aiter):
    backend = get_backend("aiter")
    assert backend.unavailable(CUDA).code is Why.NO_BACKEND
    assert resolve("auto", CUDA)[0] is None or resolve("auto", CUDA)[0].name != "aiter"
    assert resolve("aiter", CUDA)[0] is None
    backend.fingerprint()
    assert backend.prepare(call()).code is Why.RUNTIME
    assert block_aiter.attempts == [] and _aiter_modules() == []


def test_detection_stops_when_package_missing(monkeypatch, block_aiter):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert AiterBackend().unavailable(CUDA).code is Why.NO_BACKEND
    assert block_aiter.attempts == []


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100", "gfx1250", ""])
def test_detection_stops_on_unsupported_arch(monkeypatch, block_aiter, arch):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: importlib.machinery.ModuleSpec(name, None))
    props = types.SimpleNamespace(gcnArchName=arch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    assert AiterBackend().unavailable(CUDA).code is Why.NO_BACKEND
    assert block_aiter.attempts == []


def test_detection_survives_a_failing_import(monkeypatch, block_aiter):
    block_aiter.error = RuntimeError  # what `import aiter` raises on a non-ROCm torch
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: importlib.machinery.ModuleSpec(name, None))
    props = types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    reason = AiterBackend().unavailable(CUDA)
    assert reason.code is Why.NO_BACKEND
    assert block_aiter.attempts == ["aiter"]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_detection_succeeds_and_is_cached(monkeypatch, arch):
    simulate_rocm(monkeypatch, arch)
    reads = []
    props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: reads.append(index) or props)
    backend = AiterBackend()
    assert backend.unavailable(CUDA) is None
    assert backend.unavailable(torch.device("cuda")) is None  # index None: current device 0
    assert reads == [0]
    assert detection.detect(0).arch == arch


def test_cpu_device_is_declined_without_detection(block_aiter):
    assert AiterBackend().unavailable(torch.device("cpu")).code is Why.NO_BACKEND


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_auto_resolves_to_aiter_on_simulated_rocm(monkeypatch, arch):
    simulate_rocm(monkeypatch, arch)
    backend, reason = resolve("auto", CUDA)
    assert reason is None and backend.name == "aiter"


def test_auto_resolves_to_torch_on_cpu(block_aiter):
    backend, reason = resolve("auto", torch.device("cpu"))
    assert reason is None and backend.name == "torch"


@pytest.mark.parametrize("version, expected", [
    (V017, dict(choose_stage=False, norm_first=False, gemma_norm=False, per_token_quant=False,
                per_group_quant=False, flexible_hidden=False, one_stage_barrier=False)),
    (V_STAGE, dict(choose_stage=True, norm_first=True, gemma_norm=False, per_token_quant=False,
                   per_group_quant=False, flexible_hidden=False, one_stage_barrier=False)),
    (V_MAIN, dict(choose_stage=True, norm_first=True, gemma_norm=True, per_token_quant=True,
                  per_token_gemma=True, per_group_quant=True, per_group_norm_out=True,
                  flexible_hidden=True, one_stage_barrier=True)),
])
def test_api_is_read_from_signatures(version, expected):
    api = found_for(version=version).api
    for flag, value in expected.items():
        assert getattr(api, flag) == value, flag


def test_quant_dtype_follows_arch():
    assert detection.quant_dtype("gfx942") == torch.float8_e4m3fnuz
    assert detection.quant_dtype("gfx950") == torch.float8_e4m3fn


# ---------------------------------------------------------------- shape gates


def code_of(reason):
    """The reason's code, None for no reason."""
    return None if reason is None else reason.code


@pytest.mark.parametrize("kwargs, code", [
    (dict(hidden=16384), None),
    (dict(hidden=16384 + 8), Why.SHAPE),  # one pack past the hidden limit
    (dict(hidden=4096 + 8), None),
    (dict(hidden=4096 + 4), Why.SHAPE),  # not whole packs of 16 bytes
    (dict(hidden=2880), None),  # no hidden allowlist (SGLang#21986)
    (dict(hidden=4096 + 8, dtype=torch.float16), None),
    (dict(hidden=4096 + 4, dtype=torch.float16), Why.SHAPE),
    (dict(tokens=8192, hidden=4096), None),  # exactly 64 MiB: inclusive
    (dict(tokens=8193, hidden=4096), Why.SIZE_CAP),
    (dict(tokens=16384, hidden=2048), None),
    (dict(tokens=16385, hidden=2048), Why.SIZE_CAP),
    (dict(tokens=0), Why.SHAPE),
    (dict(tokens=None), None),  # symbolic at compile time: decided at run time
    (dict(weight_dtype=torch.float32), Why.WEIGHT_DTYPE),
    (dict(world_size=1), Why.WORLD_SIZE),
    (dict(world_size=2), None),
    (dict(world_size=3), Why.WORLD_SIZE),
    (dict(world_size=4), None),
    (dict(world_size=6), Why.WORLD_SIZE),
    (dict(world_size=8), None),
    (dict(world_size=16), Why.WORLD_SIZE),
])
def test_shape_check_boundaries(monkeypatch, kwargs, code):
    simulate_rocm(monkeypatch, "gfx942")
    reason = AiterBackend().shape_check(call(**kwargs))
    assert code_of(reason) is code, reason


def test_why_not_caps_bytes_even_with_a_larger_user_override(monkeypatch):
    simulate_rocm(monkeypatch, "gfx942")
    backend = AiterBackend()
    at_limit, past = call(tokens=8192, hidden=4096), call(tokens=8193, hidden=4096)
    assert backend.default_max_bytes(at_limit) == 64 * MIB
    assert backend.why_not(at_limit) is None
    assert backend.why_not(past, max_bytes_override=1024 * MIB).code is Why.SIZE_CAP  # buffer limit holds
    assert backend.why_not(call(tokens=257, hidden=4096), max_bytes_override=2 * MIB).code is Why.SIZE_CAP
    assert backend.why_not(call(tokens=256, hidden=4096), max_bytes_override=2 * MIB) is None
    assert backend.why_not(call(dtype=torch.float32)).code is Why.DTYPE  # 16-bit kernels only


@pytest.mark.parametrize("version, hidden, code", [
    (V017, 512, None), (V017, 16384, None), (V017, 256, Why.SHAPE), (V017, 2880, Why.SHAPE),
    (V017, 4096 + 512, None), (V017, 4096 + 8, Why.SHAPE),
    (V_STAGE, 2880, Why.SHAPE), (V_MAIN, 2880, None), (V_MAIN, 256, None),
])
def test_old_aiter_row_sizes(monkeypatch, version, hidden, code):
    simulate_rocm(monkeypatch, "gfx942", FakeAiter(version=version))
    reason = AiterBackend().shape_check(call(hidden=hidden))
    assert code_of(reason) is code, reason


@pytest.mark.parametrize("version, code", [(V017, Why.NORM_FORM), (V_STAGE, Why.NORM_FORM), (V_MAIN, None)])
def test_gemma_needs_gemma_norm(monkeypatch, version, code):
    simulate_rocm(monkeypatch, "gfx942", FakeAiter(version=version))
    reason = AiterBackend().shape_check(call(norm="gemma_rms"))
    assert code_of(reason) is code, reason


# ---------------------------------------------------------------- 1-stage vs 2-stage


@pytest.mark.parametrize("kwargs, one_stage", [
    (dict(tokens=80, hidden=2048, world_size=2), True),
    (dict(tokens=81, hidden=2048, world_size=2), False),  # kMaxBlocks
    (dict(tokens=80, hidden=8192, world_size=2), True),  # ws=2: no byte limit below 80 tokens
    (dict(tokens=1, hidden=8192, world_size=8), True),  # 8192 / 8 = 1024 packs
    (dict(tokens=1, hidden=8192 + 8, world_size=8), False),  # 1025 packs
    (dict(tokens=32, hidden=4096, world_size=4), True),  # exactly 256 KiB
    (dict(tokens=33, hidden=4096, world_size=4), False),
    (dict(tokens=32, hidden=4096 + 8, world_size=4), False),  # one pack per row past 256 KiB
    (dict(tokens=16, hidden=4096, world_size=8), True),  # exactly 128 KiB
    (dict(tokens=17, hidden=4096, world_size=8), False),
    (dict(tokens=16, hidden=4096 + 8, world_size=8), False),
    (dict(tokens=64, hidden=1024, world_size=8), True),  # 128 KiB with another shape
    (dict(tokens=64, hidden=1024, dtype=torch.float16, world_size=8), True),
])
def test_one_stage_choice(kwargs, one_stage):
    c = call(**kwargs)
    assert stages.use_one_stage(c, found_for().api) is one_stage


@pytest.mark.parametrize("hidden, one_stage", [(4096, True), (2048, True), (5120, False), (2880, False)])
def test_one_stage_on_old_aiter_only_for_its_hidden_sizes(hidden, one_stage):
    # An aiter without IPCBufferPool, as if its 1-stage kernels had the closing barrier.
    api = dataclasses.replace(found_for(version=V_STAGE).api, one_stage_barrier=True)
    assert stages.use_one_stage(call(tokens=1, hidden=hidden), api) is one_stage


@pytest.mark.parametrize("version, barrier", [
    ("0.1.19", False), ("0.1.19.post1", True), ("0.1.20.post1", True),  # releases: the fix from v0.1.19.post1
    ("0.1.20.dev1+g9312ef7c01", False), ("0.1.20.dev2+g0e47575820", True),  # main: from v0.1.19-2
    ("0.1.13+g03644e5", False), (V_STAGE, False), (V017, False),
    ("0.1.19.post1.dev3", False), ("0.1.20rc1", False), ("0.1.0", False), ("unknown", False),  # unreadable: without
])
def test_one_stage_only_where_its_kernels_end_with_a_barrier(version, barrier):
    """aiter#4346: before it, a 1-stage fused call could let a rank reuse its buffer while a peer
    still read it. Only the version tells; without the fix every call takes the 2-stage kernel."""
    assert detection.has_one_stage_barrier(version) is barrier
    api = dataclasses.replace(found_for().api, one_stage_barrier=detection.has_one_stage_barrier(version))
    assert stages.use_one_stage(call(tokens=1, hidden=4096), api) is barrier


# ---------------------------------------------------------------- which stages are planned


def plan_for(monkeypatch, c: Call, arch="gfx950", version=V_MAIN, env=False, fp8=None):
    fp8_dtype = limits.LIMITS.fp8_dtypes[arch]
    monkeypatch.setattr(quant, "quantize", lambda n, f, s: fake_quantize(n, f, s, fp8_dtype))
    return stages.plan(c, found_for(arch, version, fp8), env)


@pytest.mark.parametrize("kwargs, arch, first", [
    (dict(quant_form="none"), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="fp8_group", emit_norm=False), "gfx950", stages.FUSED_QUANT),
    (dict(quant_form="fp8_group", emit_norm=True), "gfx950", stages.FUSED_QUANT),
    (dict(quant_form="fp8_group", emit_norm=False), "gfx942", stages.FUSED_NORM),  # gfx95x only
    (dict(quant_form="fp8_dynamic", emit_norm=False), "gfx950", stages.FUSED_QUANT),
    (dict(quant_form="fp8_dynamic", emit_norm=False), "gfx942", stages.FUSED_NORM),
    (dict(quant_form="fp8_dynamic", emit_norm=True), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="fp8_static", emit_norm=False), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="nvfp4", emit_norm=False), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="fp8_group", norm="gemma_rms", emit_norm=False), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="fp8_dynamic", norm="gemma_rms", emit_norm=False), "gfx950", stages.FUSED_QUANT),
    (dict(quant_form="fp8_group", hidden=4096 + 64, emit_norm=False), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="fp8_dynamic", hidden=7168, emit_norm=False), "gfx950", stages.FUSED_QUANT),
    (dict(quant_form="fp8_dynamic", hidden=5120, emit_norm=False), "gfx950", stages.FUSED_NORM),
    (dict(quant_form="fp8_dynamic", tokens=512, emit_norm=False), "gfx950", stages.FUSED_QUANT),  # 4 MiB
    (dict(quant_form="fp8_dynamic", tokens=513, emit_norm=False), "gfx950", stages.FUSED_NORM),
])
def test_plan(monkeypatch, kwargs, arch, first):
    planned, skipped = plan_for(monkeypatch, call(**kwargs), arch)
    assert planned[0] == first and planned[-2:] == [stages.FUSED_NORM, stages.UNFUSED]
    assert bool(skipped) == (kwargs["quant_form"] != "none" and first != stages.FUSED_QUANT)


def test_plan_without_quant_kernels_in_old_aiter(monkeypatch):
    planned, skipped = plan_for(monkeypatch, call(quant_form="fp8_group", emit_norm=False),
                                version=V_STAGE)
    assert planned == [stages.FUSED_NORM, stages.UNFUSED] and "no per-group" in skipped[0]


def test_env_opt_out_keeps_the_norm_fusion(monkeypatch):
    planned, skipped = plan_for(monkeypatch, call(quant_form="fp8_group", emit_norm=False), env=True)
    assert planned == [stages.FUSED_NORM, stages.UNFUSED] and limits.DISABLE_QUANT_ENV in skipped[0]
    for value, disabled in [("1", True), ("0", False), ("", False), ("off", False), ("yes", True)]:
        monkeypatch.setenv(limits.DISABLE_QUANT_ENV, value)
        assert detection.quant_disabled_by_env() is disabled


def test_plan_needs_aiter_fp8_to_match_the_arch(monkeypatch):
    c = call(quant_form="fp8_group", emit_norm=False)
    planned, skipped = plan_for(monkeypatch, c, "gfx950", fp8=torch.float8_e4m3fnuz)
    assert planned[0] == stages.FUSED_NORM and "fp8 dtype" in skipped[0]


def test_plan_needs_the_reference_quant_layout(monkeypatch):
    c = call(quant_form="fp8_group", emit_norm=False)
    found = found_for("gfx950")
    # The reference quant still raising NotImplementedError (not written yet): no one-kernel.
    monkeypatch.setattr(quant, "quantize", lambda n, f, s: (_ for _ in ()).throw(NotImplementedError()))
    planned, skipped = stages.plan(c, found, False)
    assert planned[0] == stages.FUSED_NORM and "reference quant layout unknown" in skipped[0]
    # A reference producing a transposed scale: no one-kernel either. (The FP8 dtype is not
    # compared: both sides take it from the arch, which a meta-device probe cannot see.)
    for other in (
        lambda n, f, s: {**fake_quantize(n, f, s, torch.float8_e4m3fn),
                         "scale": fake_quantize(n, f, s, torch.float8_e4m3fn)["scale"].t().contiguous().t()},
    ):
        stages._reference_layout.cache_clear()
        monkeypatch.setattr(quant, "quantize", other)
        planned, skipped = stages.plan(c, found, False)
        assert planned[0] == stages.FUSED_NORM and "differ from the reference" in skipped[0]


# ---------------------------------------------------------------- runs: outputs and aiter calls


SITES = [
    dict(residual=True), dict(residual=False),
    dict(quant_form="fp8_group", emit_norm=False), dict(quant_form="fp8_group", emit_norm=True),
    dict(quant_form="fp8_group", residual=False, emit_norm=False),
    dict(quant_form="fp8_dynamic", emit_norm=False), dict(quant_form="fp8_dynamic", emit_norm=True),
    dict(quant_form="fp8_static", emit_norm=False),
]


@pytest.mark.parametrize("version", [V017, V_STAGE, V_MAIN])
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("site", SITES)
def test_outputs_match_reference_in_site_order(rocm_env, version, arch, site):
    fake = rocm_env(arch, version)
    run_and_expect(AiterBackend(), call(**site))
    assert fake.violations == []
    assert "custom_all_reduce" not in fake.names()  # a fused stage produced the result


@pytest.mark.parametrize("site", [dict(norm="gemma_rms"), dict(norm="gemma_rms", residual=False),
                                  dict(norm="gemma_rms", quant_form="fp8_dynamic", emit_norm=False)])
def test_gemma_outputs_match_reference(rocm_env, site):
    fake = rocm_env("gfx950", V_MAIN)
    run_and_expect(AiterBackend(), call(**site))
    assert fake.violations == [] and fake.calls[-1][2]["gemma_norm"] is True


def test_call_contract_0_1_7(rocm_env):
    fake = rocm_env("gfx942", V017)
    c = call(tokens=4, residual=False)
    run_and_expect(AiterBackend(), c)
    (init, init_args, init_kwargs), (name, args, kwargs) = fake.calls
    assert init == "__init__" and init_args == (f"gloo:pg:{GROUP}", CUDA)
    assert init_kwargs == {"max_size": 128 * MIB}
    assert name == "custom_fused_ar_rms" and len(args) == 4 and kwargs == {}
    x, residual, weight, eps = args
    assert residual.shape == x.shape and not residual.any()  # zeros, never empty
    assert x.is_contiguous() and x.dim() == 2


@pytest.mark.parametrize("version, says", [(V_STAGE, True), (V_MAIN, False)])
def test_detection_says_when_it_keeps_to_the_two_stage_kernel(monkeypatch, caplog, version, says):
    simulate_rocm(monkeypatch, "gfx942", FakeAiter(version=version))
    with caplog.at_level(logging.INFO, logger="arfusion"):
        found = detection.detect(0)
    assert found.api.one_stage_barrier is not says
    assert ("aiter#4346" in caplog.text) is says


@pytest.mark.parametrize("version, tokens, one_stage", [
    (V_MAIN, 80, True), (V_MAIN, 81, False),
    (V_STAGE, 80, False),  # its 1-stage kernels lack aiter#4346's closing barrier
])
def test_call_contract_stage_choice(rocm_env, version, tokens, one_stage):
    fake = rocm_env("gfx942", version)
    run_and_expect(AiterBackend(), call(tokens=tokens, hidden=1024))
    name, args, kwargs = fake.calls[-1]
    assert name == "custom_fused_ar_rms" and len(args) == 4 and kwargs == {"use_1stage": one_stage}


def test_call_contract_main(rocm_env):
    fake = rocm_env("gfx950", V_MAIN)
    backend = AiterBackend()
    run_and_expect(backend, call(quant_form="fp8_group", emit_norm=True))
    run_and_expect(backend, call(quant_form="fp8_group", emit_norm=False))
    run_and_expect(backend, call(quant_form="fp8_dynamic", emit_norm=False, tokens=200))
    run_and_expect(backend, call(norm="gemma_rms", tokens=200))
    assert fake.names() == ["__init__", "custom_fused_ar_rms_per_group_quant",
                            "custom_fused_ar_rms_per_group_quant", "custom_fused_ar_rms_quant",
                            "custom_fused_ar_rms"]
    assert [len(args) for _, args, _ in fake.calls[1:]] == [4, 4, 4, 4]
    assert [kw for _, _, kw in fake.calls[1:]] == [
        {"group_size": 128, "use_1stage": True, "emit_bf16": True},
        {"group_size": 128, "use_1stage": True},
        {"use_1stage": False},
        {"use_1stage": False, "gemma_norm": True},
    ]
    assert fake.violations == []


def test_three_dimensional_input_is_flattened(rocm_env):
    fake = rocm_env("gfx950", V_MAIN)
    c = call(tokens=6)
    x, residual, weight, eps, _ = inputs(c)
    outs = AiterBackend().run(c, x.reshape(2, 3, -1), residual.reshape(2, 3, -1), weight, eps, None)
    assert [o.shape for o in outs] == [torch.Size([6, c.hidden])] * 2
    assert fake.calls[-1][1][0].shape == (6, c.hidden)


# ---------------------------------------------------------------- the fallback chain


@pytest.mark.parametrize("mode", ["none", "raise"])
def test_quant_kernel_unavailable_falls_back_to_norm_kernel_then_quant(rocm_env, caplog, mode):
    fake = rocm_env("gfx950", V_MAIN, behaviour={"custom_fused_ar_rms_per_group_quant": mode})
    backend = AiterBackend()
    with caplog.at_level(logging.INFO, logger="arfusion"):
        for _ in range(2):
            run_and_expect(backend, call(quant_form="fp8_group", emit_norm=True))
    assert fake.names()[1:] == ["custom_fused_ar_rms_per_group_quant", "custom_fused_ar_rms"] * 2
    fell = [r for r in caplog.records if "trying the next stage" in r.getMessage()]
    assert len(fell) == 1  # once per reason
    assert ("returned None" if mode == "none" else "RuntimeError") in fell[0].getMessage()


@pytest.mark.parametrize("mode", ["none", "raise"])
def test_norm_kernel_unavailable_falls_back_to_unfused(rocm_env, mode):
    fake = rocm_env("gfx942", V_MAIN, behaviour={"custom_fused_ar_rms": mode})
    run_and_expect(AiterBackend(), call(quant_form="fp8_group", emit_norm=True))
    assert fake.names()[1:] == ["custom_fused_ar_rms", "custom_all_reduce"]


def test_every_kernel_unavailable_ends_at_the_reference(rocm_env, monkeypatch):
    fake = rocm_env("gfx950", V_MAIN, behaviour={
        "custom_fused_ar_rms_quant": "none", "custom_fused_ar_rms": "raise", "custom_all_reduce": "none"})
    torch_all_reduces = []
    monkeypatch.setattr(reference, "all_reduce_sum",
                        lambda x, group: torch_all_reduces.append(group) or fake.reduce(x))
    run_and_expect(AiterBackend(), call(quant_form="fp8_dynamic", emit_norm=False))
    assert fake.names()[1:] == ["custom_fused_ar_rms_quant", "custom_fused_ar_rms", "custom_all_reduce"]
    assert torch_all_reduces == [GROUP, GROUP]  # the backend's fallback, then the expectation


def test_reference_errors_propagate(rocm_env, monkeypatch):
    rocm_env("gfx942", V_MAIN)
    monkeypatch.setattr(quant, "quantize", lambda n, f, s: (_ for _ in ()).throw(NotImplementedError("q")))
    c = call(quant_form="fp8_static", emit_norm=False)
    with pytest.raises(NotImplementedError):
        AiterBackend().run(c, *inputs(c))


def test_plain_all_reduce_raising_uses_torch(rocm_env):
    fake = rocm_env("gfx942", V017, behaviour={"custom_fused_ar_rms": "none", "custom_all_reduce": "raise"})
    run_and_expect(AiterBackend(), call())
    assert fake.names()[1:] == ["custom_fused_ar_rms", "custom_all_reduce"]


def test_env_opt_out_at_run_time(rocm_env, monkeypatch):
    fake = rocm_env("gfx950", V_MAIN)
    monkeypatch.setenv(limits.DISABLE_QUANT_ENV, "1")
    run_and_expect(AiterBackend(), call(quant_form="fp8_group", emit_norm=False))
    assert fake.names()[1:] == ["custom_fused_ar_rms"]


def test_failed_set_up_runs_unfused_and_is_not_retried(rocm_env):
    fake = rocm_env("gfx950", V_MAIN, ctor_raises=True)
    backend = AiterBackend()
    assert backend.prepare(call()).code is Why.RUNTIME
    run_and_expect(backend, call())
    run_and_expect(backend, call(tokens=7))
    assert fake.names() == ["__init__"]


def test_disabled_communicator_runs_unfused(rocm_env):
    fake = rocm_env("gfx950", V_MAIN, disabled=True)
    backend = AiterBackend()
    assert backend.prepare(call()).code is Why.RUNTIME
    run_and_expect(backend, call())
    run_and_expect(backend, call())
    assert fake.names() == ["__init__"]


def test_no_set_up_during_graph_capture(rocm_env, monkeypatch):
    fake = rocm_env("gfx950", V_MAIN)
    backend = AiterBackend()
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert backend.prepare(call()).code is Why.RUNTIME
    run_and_expect(backend, call())
    assert fake.names() == []
    monkeypatch.setattr(runtime, "capturing", lambda: False)
    assert backend.prepare(call()) is None
    run_and_expect(backend, call())
    assert fake.names() == ["__init__", "custom_fused_ar_rms"]


def test_one_communicator_per_group(rocm_env):
    fake = rocm_env("gfx950", V_MAIN)
    backend = AiterBackend()
    run_and_expect(backend, call())
    run_and_expect(backend, call(tokens=9))
    other = Call(**{**call().__dict__, "group_name": "tp1"})
    backend.run(other, *inputs(other))
    assert fake.names().count("__init__") == 2
    backend.close()
    assert backend._communicators == {}


@pytest.mark.parametrize("same_ranks", [True, False])
def test_groups_of_the_same_ranks_share_one_communicator(rocm_env, monkeypatch, same_ranks):
    """transformers >= 5.25 all-reduces a MoE layer's experts over an expert-parallel group of the
    TP group's ranks: one CustomAllreduce (and one quick all-reduce) serves both."""
    fake = rocm_env("gfx950", V_MAIN)
    ranks = {f"pg:{GROUP}": [0, 1], "pg:tp1": [0, 1] if same_ranks else [2, 3]}
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: ranks[group])
    backend = AiterBackend()
    run_and_expect(backend, call())
    other = Call(**{**call().__dict__, "group_name": "tp1"})
    backend.run(other, *inputs(other))
    assert fake.names().count("__init__") == (1 if same_ranks else 2)
    assert (backend._communicators[GROUP] is backend._communicators["tp1"]) == same_ranks
    backend.close()
    assert backend._communicators == {}


def test_a_recreated_group_gets_a_new_communicator(rocm_env, monkeypatch):
    """destroy_process_group + init_process_group hand the name out again for other peers: the old
    communicator (IPC buffers of the old peers) must not serve the new group. Failed before the
    fix: one __init__, the new group reduced through the old group's communicator."""
    fake = rocm_env("gfx950", V_MAIN)
    live = {GROUP: object()}  # what torch's registry resolves the name to
    monkeypatch.setattr(communicator, "resolve", lambda name: live[name])
    monkeypatch.setattr(communicator, "gloo_twin", lambda group: ("gloo", group))
    backend = AiterBackend()
    run_and_expect(backend, call())
    run_and_expect(backend, call(tokens=9))
    first = live[GROUP]
    live[GROUP] = object()  # the same name, a new ProcessGroup
    run_and_expect(backend, call())
    inits = [args for name, args, _ in fake.calls if name == "__init__"]
    assert [group for group, *_ in inits] == [("gloo", first), ("gloo", live[GROUP])]
    assert len(backend._communicators.stale) == 1  # kept for graphs captured before, closed at close()
    backend.close()
    assert backend._communicators == {} and backend._communicators.stale == []


# ---------------------------------------------------------------- the gloo twin group


def test_gloo_twin_reuses_gloo_and_creates_one_per_rank_set(monkeypatch):
    created = []
    backends = {"g": "gloo", "n1": "nccl", "n2": "nccl"}
    ranks = {"g": [0, 1], "n1": [0, 1], "n2": [0, 1]}  # the live groups, as torch's registry

    def new_group(r, **kw):
        created.append((r, kw))
        ranks[name := f"gloo{len(created)}"] = r
        return name

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group: backends[group])
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: ranks[group])
    monkeypatch.setattr(torch.distributed, "new_group", new_group)
    assert communicator.gloo_twin("g") == "g"
    assert communicator.gloo_twin("n1") == communicator.gloo_twin("n2") == "gloo1"
    assert created == [([0, 1], {"backend": "gloo", "use_local_synchronization": True})]
    # destroy_process_group takes the twin with it: the next set-up on those ranks makes a new one
    # (before, the destroyed twin was handed out again and aiter's handle exchange failed on it).
    del ranks["gloo1"]
    assert communicator.gloo_twin("n1") == "gloo2" and len(created) == 2


# ---------------------------------------------------------------- the plain all-reduce


def plain(nbytes: int | None = 4 * 4096 * 2, dtype=BF16, world_size=2, hidden=4) -> Call:
    """A plain all-reduce of exactly `nbytes` per rank (None: tokens unknown, compile time)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    tokens = None if nbytes is None else nbytes // (hidden * itemsize)
    assert nbytes is None or tokens * hidden * itemsize == nbytes
    return Call(form=PLAIN, tokens=tokens, hidden=hidden, dtype=dtype, weight_dtype=dtype,
                world_size=world_size, device=CUDA, group_name=GROUP)


@pytest.fixture
def car_env(monkeypatch):
    """aiter's own window variables, unset unless a test sets them."""
    for name in (limits.CUSTOM_AR_MIN_SIZE_ENV, limits.CUSTOM_AR_MAX_SIZE_ENV):
        monkeypatch.delenv(name, raising=False)

    def set_window(low=None, high=None):
        for name, value in ((limits.CUSTOM_AR_MIN_SIZE_ENV, low), (limits.CUSTOM_AR_MAX_SIZE_ENV, high)):
            if value is not None:
                monkeypatch.setenv(name, str(value))

    return set_window


def test_plain_is_declined_off_rocm(block_aiter, car_env):
    backend = AiterBackend()
    assert backend.plain_why_not(plain()).code is Why.NO_BACKEND
    assert backend.plain_why_not(Call(**{**plain().__dict__, "device": torch.device("cpu")})).code is Why.NO_BACKEND
    assert block_aiter.attempts == []


@pytest.mark.parametrize("nbytes, code", [
    (64 * MIB, None),  # aiter's default cutoff, inclusive (`inp_size <= 8192 * 8192`)
    (64 * MIB + 16, Why.SIZE_CAP),
    (16, None),  # the default floor is 0, exclusive: the smallest multiple of 16 fits
    (8, Why.SHAPE),  # not a multiple of 16 bytes
    (24, Why.SHAPE),
    (0, Why.SHAPE),
    (None, None),  # tokens unknown at compile time: decided at run time
])
def test_plain_default_window(monkeypatch, car_env, nbytes, code):
    simulate_rocm(monkeypatch, "gfx942")
    reason = AiterBackend().plain_why_not(plain(nbytes))
    assert code_of(reason) is code, reason


@pytest.mark.parametrize("low, high, nbytes, ok", [
    (MIB, 2 * MIB, MIB, False),  # at the floor: aiter leaves it to RCCL (exclusive)
    (MIB, 2 * MIB, MIB + 16, True),
    (MIB, 2 * MIB, 2 * MIB, True),  # at the cutoff: inclusive
    (MIB, 2 * MIB, 2 * MIB + 16, False),
    (None, 0, 16, False),  # 0 turns aiter's custom all-reduce off
    (None, 0, None, False),  # ... at compile time too
    (2 * MIB, 2 * MIB, None, False),  # an empty window
    (None, 96 * MIB, 64 * MIB + 16, False),  # aiter would go on to 96 MiB; arfusion stops at 64
    (None, 96 * MIB, 64 * MIB, True),
    (None, 256 * MIB, 64 * MIB, True),  # above aiter's pool (arfusion's 128 MiB): aiter's default
    (None, 256 * MIB, 64 * MIB + 16, False),
    (None, "lots", 64 * MIB, True),  # unparsable: aiter's default
    (-5, None, 16, True),  # negative floor: aiter's default 0
    ("x", None, 16, True),
])
def test_plain_window_from_aiters_environment(monkeypatch, car_env, low, high, nbytes, ok):
    """Every size outside the window is declined as over (or under) its cap."""
    simulate_rocm(monkeypatch, "gfx942")
    car_env(low, high)
    reason = AiterBackend().plain_why_not(plain(nbytes))
    assert code_of(reason) is (None if ok else Why.SIZE_CAP), reason
    if not ok and low == MIB and nbytes == MIB:
        assert limits.CUSTOM_AR_MIN_SIZE_ENV in reason.message  # names the knob


def test_plain_user_cap_lowers_but_never_raises(monkeypatch, car_env):
    simulate_rocm(monkeypatch, "gfx942")
    backend = AiterBackend()
    assert backend.plain_why_not(plain(2 * MIB), max_bytes_override=2 * MIB) is None
    reason = backend.plain_why_not(plain(2 * MIB + 16), max_bytes_override=2 * MIB)
    assert reason.code is Why.SIZE_CAP and "plain_max_size_mb" in reason.message  # names the knob
    assert backend.plain_why_not(plain(16), max_bytes_override=0).code is Why.SIZE_CAP  # 0: never
    assert backend.plain_why_not(plain(None), max_bytes_override=0).code is Why.SIZE_CAP
    assert backend.plain_why_not(plain(64 * MIB + 16), max_bytes_override=1024 * MIB).code is Why.SIZE_CAP


@pytest.mark.parametrize("dtype, ok", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, True),
                                       (torch.float64, False), (torch.int32, False)])
def test_plain_dtypes(monkeypatch, car_env, dtype, ok):
    simulate_rocm(monkeypatch, "gfx942")
    reason = AiterBackend().plain_why_not(plain(4096, dtype=dtype))
    assert code_of(reason) is (None if ok else Why.DTYPE), reason


@pytest.mark.parametrize("world_size, ok", [(1, False), (2, True), (3, False), (4, True), (6, True),
                                            (8, True), (16, False)])
def test_plain_world_sizes(monkeypatch, car_env, world_size, ok):
    """CustomAllreduce's own list (6 included, unlike the fused kernel's)."""
    simulate_rocm(monkeypatch, "gfx942")
    reason = AiterBackend().plain_why_not(plain(4096, world_size=world_size))
    assert code_of(reason) is (None if ok else Why.WORLD_SIZE), reason


WINDOWS = [(None, None), (MIB, 2 * MIB), (None, 0), (None, 96 * MIB), (None, 256 * MIB), (3 * MIB, MIB)]
SIZES = [16, 8192, MIB, MIB + 16, 2 * MIB, 2 * MIB + 16, 64 * MIB, 64 * MIB + 16, 96 * MIB, 96 * MIB + 16]


@pytest.mark.parametrize("low, high", WINDOWS)
@pytest.mark.parametrize("version", [V017, V_STAGE, V_MAIN])
def test_plain_decisions_agree_with_aiters_own(rocm_env, car_env, version, low, high):
    """What arfusion accepts, aiter's custom_all_reduce takes (never a None by surprise); on the
    aiter with the window (V_MAIN), exactly the same sizes up to arfusion's 64 MiB."""
    car_env(low, high)
    fake = rocm_env("gfx942", version)
    backend = AiterBackend()
    assert backend.prepare_plain(plain()) is None
    comm = fake.instances[0]
    for nbytes in SIZES:
        ours = backend.plain_why_not(plain(nbytes)) is None
        if not ours and (version != V_MAIN or nbytes > 64 * MIB):
            continue  # nothing to compare: arfusion declines, aiter's answer may be either
        theirs = comm.custom_all_reduce(torch.zeros(nbytes // 2, dtype=BF16).view(-1, 8)) is not None
        assert not ours or theirs, (nbytes, "arfusion takes what aiter declines")
        if version == V_MAIN:
            assert ours == theirs, nbytes
    assert fake.violations == []


def test_plain_all_reduce_calls_aiter_with_its_argument_order(rocm_env, car_env):
    fake = rocm_env("gfx942", V_MAIN)
    backend = AiterBackend()
    c = plain(16 * 4096 * 2, hidden=4096)
    x = torch.randn(16, 4096).to(BF16)
    assert backend.plain_why_not(c) is None and backend.prepare_plain(c) is None
    out = backend.all_reduce(c, x)
    (init, init_args, init_kwargs), (name, args, kwargs) = fake.calls
    assert init == "__init__" and init_args == (f"gloo:pg:{GROUP}", CUDA) and init_kwargs == {"max_size": 128 * MIB}
    assert name == "custom_all_reduce" and kwargs == {} and len(args) == 1 and args[0] is x
    assert fake.results == [("custom_all_reduce", out)] and torch.equal(out, fake.reduce(x))
    assert fake.violations == []


@pytest.mark.parametrize("version", [V017, V_STAGE])
def test_plain_all_reduce_on_older_aiter(rocm_env, car_env, version):
    fake = rocm_env("gfx942", version)
    backend = AiterBackend()
    c, x = plain(1024, hidden=8), torch.randn(64, 8).to(torch.float16)
    c = Call(**{**c.__dict__, "dtype": torch.float16, "weight_dtype": torch.float16})
    assert backend.prepare_plain(c) is None
    assert torch.equal(backend.all_reduce(c, x), fake.reduce(x))
    assert fake.names() == ["__init__", "custom_all_reduce"] and fake.violations == []


@pytest.mark.parametrize("mode, logged", [("none", "returned None"), ("raise", "raised RuntimeError")])
def test_plain_all_reduce_falls_back_to_torchs_sum(rocm_env, car_env, monkeypatch, caplog, mode, logged):
    fake = rocm_env("gfx942", V_MAIN, behaviour={"custom_all_reduce": mode})
    torch_sums = []
    monkeypatch.setattr(reference, "all_reduce_sum", lambda x, group: torch_sums.append((x, group)) or x + x)
    backend = AiterBackend()
    c, x = plain(), torch.randn(1024, 8).to(BF16)
    assert backend.prepare_plain(c) is None
    with caplog.at_level(logging.INFO, logger="arfusion"):
        outs = [backend.all_reduce(c, x) for _ in range(2)]
    assert all(torch.equal(out, x + x) for out in outs)
    assert [(got is x, group) for got, group in torch_sums] == [(True, GROUP)] * 2
    assert fake.names() == ["__init__", "custom_all_reduce", "custom_all_reduce"]
    assert sum(logged in r.getMessage() for r in caplog.records) == 1  # once


def test_plain_shares_the_fused_sites_communicator(rocm_env, car_env):
    fake = rocm_env("gfx950", V_MAIN)
    backend = AiterBackend()
    run_and_expect(backend, call())
    assert backend.prepare_plain(plain()) is None
    backend.all_reduce(plain(), torch.randn(1024, 8).to(BF16))
    assert fake.names() == ["__init__", "custom_fused_ar_rms", "custom_all_reduce"]
    backend.close()
    assert backend._communicators == {}


def test_plain_set_up_never_during_capture_and_capture_after_it(rocm_env, car_env, monkeypatch):
    fake = rocm_env("gfx942", V_MAIN)
    backend = AiterBackend()
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert backend.prepare_plain(plain()).code is Why.RUNTIME
    assert fake.calls == []
    monkeypatch.setattr(runtime, "capturing", lambda: False)
    assert backend.prepare_plain(plain()) is None
    monkeypatch.setattr(runtime, "capturing", lambda: True)  # set up: captures call it as eager does
    assert backend.prepare_plain(plain()) is None
    x = torch.randn(1024, 8).to(BF16)
    assert torch.equal(backend.all_reduce(plain(), x), fake.reduce(x))
    assert fake.names() == ["__init__", "custom_all_reduce"] and fake.calls[-1][1:] == ((x,), {})


@pytest.mark.parametrize("setup", [dict(disabled=True), dict(ctor_raises=True)])
def test_plain_failed_set_up_is_declined_and_not_retried(rocm_env, car_env, setup):
    fake = rocm_env("gfx942", V_MAIN, **setup)
    backend = AiterBackend()
    first = backend.prepare_plain(plain())
    assert first.code is Why.RUNTIME
    assert backend.prepare_plain(plain(8192)) == first  # the same verdict, not a second set-up
    assert fake.names() == ["__init__"]


def _plain_on_two_ranks(rank):
    """aiter giving nothing (None, or raising) on 2 gloo ranks: the sum comes from torch's real
    all-reduce. The fake aiter in each process; its own results are world_size * x, not sums."""
    out = {}
    group_name = dist.group.WORLD.group_name
    for mode in ("none", "raise"):
        for dtype in (torch.float32, torch.bfloat16):
            fake = FakeAiter(version=V_MAIN, behaviour={"custom_all_reduce": mode})
            with pytest.MonkeyPatch.context() as mp:
                simulate_rocm(mp, "gfx942", fake)
                detection.detect.cache_clear()
                backend = AiterBackend()
                c = Call(**{**plain(64 * 1024 * 2, dtype, hidden=1024).__dict__, "group_name": group_name})
                xs = [torch.randn(c.tokens, c.hidden, generator=torch.Generator().manual_seed(r)).to(dtype)
                      for r in range(2)]
                verdict = backend.plain_why_not(c) or backend.prepare_plain(c)
                got = backend.all_reduce(c, xs[rank])
                backend.close()
                out[f"{mode}-{dtype}"] = {"verdict": verdict, "exact": torch.equal(got, xs[0] + xs[1]),
                                          "calls": fake.names(), "violations": fake.violations}
                detection.detect.cache_clear()
            del fake, backend  # the fake's call log holds the group (see test_aiter_quick_reduce)
            gc.collect()
    return out


@pytest.mark.slow
@pytest.mark.multiproc
def test_plain_fallback_gives_the_exact_sum_on_two_ranks(tmp_path):
    for r in collect_from_ranks(_plain_on_two_ranks, 2, tmp_path):
        for name, result in r.items():
            assert result["verdict"] is None, name
            assert result["exact"], name
            assert result["calls"] == ["__init__", "custom_all_reduce", "close"] and result["violations"] == []
