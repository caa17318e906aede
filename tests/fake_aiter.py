"""A stand-in for aiter's custom all-reduce, written from aiter's documented signatures.

It checks arfusion's side of the contract (argument names, positional order, return order,
None when disabled) and computes results on the CPU with arfusion's own reference math, so
nothing here says anything about aiter's kernels.

The signatures below are aiter's, copied as signatures only (names, order, defaults) from:
  V017:  amd-aiter 0.1.7.post2.dev18 (PyPI), aiter/dist/device_communicators/custom_all_reduce.py
  V_STAGE: ROCm/aiter commit 86a98ee, same file (use_1stage added, return order flipped)
  V_MAIN: ROCm/aiter main commit 03644e5, same file (gemma_norm, quant variants, IPCBufferPool)
"""

from __future__ import annotations

import functools
import importlib.machinery
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from arfusion import reference

V017, V_STAGE, V_MAIN = "0.1.7.post2.dev18", "0.1.9+g86a98ee", "0.1.13+g03644e5"


# --- documented signatures, one namespace per version (bodies are never run) -------------

class _Sig017:
    def __init__(self, group, device, max_size=8192 * 1024 * 8): ...
    def custom_all_reduce(self, input, open_fp8_quant=False): ...
    # returns (res_out, out)
    def custom_fused_ar_rms(self, input, residual_inp, weight, eps): ...
    def close(self): ...


class _SigStage:
    def __init__(self, group, device, max_size=8192 * 1024 * 8 * 2): ...
    def custom_all_reduce(self, input, use_new=True, open_fp8_quant=False): ...
    # returns (out, res_out)
    def custom_fused_ar_rms(self, input, residual_inp, weight, eps, use_1stage): ...
    def close(self): ...


class _SigMain:
    def __init__(self, group, device, max_size=1024 * 1024 * 1024,
                 enable_register_for_capturing=True): ...
    def custom_all_reduce(self, input, use_new=True, open_fp8_quant=False): ...
    # returns (out, res_out)
    def custom_fused_ar_rms(self, input, residual_inp, weight, eps, use_1stage,
                            out_hidden_dim=0, gemma_norm=False): ...
    # returns (fp8, res_out, scale [T, 1]) (+ bf16 norm when emit_bf16)
    def custom_fused_ar_rms_quant(self, input, residual_inp, weight, eps, use_1stage,
                                  gemma_norm=False, emit_bf16=False): ...
    # returns (fp8, res_out, scale [T, H/group]) (+ bf16 norm when emit_bf16)
    def custom_fused_ar_rms_per_group_quant(self, input, residual_inp, weight, eps, group_size=128,
                                            use_1stage=False, emit_bf16=False): ...
    def close(self): ...


SIGNATURES = {V017: _Sig017, V_STAGE: _SigStage, V_MAIN: _SigMain}
NORM_FIRST = {V017: False, V_STAGE: True, V_MAIN: True}


# --- a quant both the fake kernels and the tests' reference quant use ---------------------

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


def fake_quantize(normed: torch.Tensor, form: str, scale: torch.Tensor | None,
                  fp8: torch.dtype) -> dict[str, torch.Tensor]:
    """Simple symmetric FP8 quant, meta-tensor friendly. Stands in for arfusion.quant."""
    x = normed.float()
    if form == "fp8_static":
        return {"quant": (x / scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)}
    if form == "fp8_group":
        groups = x.reshape(*x.shape[:-1], -1, 128)
        s = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX[fp8]
        q = (groups / s.unsqueeze(-1)).reshape(x.shape).to(fp8)
        return {"quant": q, "scale": s}
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX[fp8]  # fp8_dynamic: per token
    return {"quant": (x / s).to(fp8), "scale": s}


# --- the fake CustomAllreduce --------------------------------------------------------------

@dataclass
class FakeAiter:
    """Builds the fake modules for one aiter version and records every call into them."""

    version: str = V_MAIN
    world_size: int = 2
    fp8: torch.dtype = torch.float8_e4m3fn
    disabled: bool = False
    # method name -> "ok" | "none" | "raise"
    behaviour: dict[str, str] = field(default_factory=dict)
    ctor_raises: bool = False
    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    instances: list[Any] = field(default_factory=list)

    # ---- simulated math: every rank holds the same x, so the sum is world_size * x
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.world_size

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    def _kernels(self) -> dict[str, Callable]:
        fake = self

        def add_norm(x, residual, weight, eps, gemma):
            res_out = residual + fake.reduce(x)
            return reference.rms_norm(res_out, weight, eps, "gemma_rms" if gemma else "rms"), res_out

        def custom_all_reduce(self, input, *rest, **kw):
            return fake.reduce(input)

        def custom_fused_ar_rms(self, input, residual_inp, weight, eps, *rest, gemma_norm=False, **kw):
            out, res_out = add_norm(input, residual_inp, weight, eps, gemma_norm)
            return (out, res_out) if NORM_FIRST[fake.version] else (res_out, out)

        def quantized(form, input, residual_inp, weight, eps, gemma, emit_bf16):
            out, res_out = add_norm(input, residual_inp, weight, eps, gemma)
            q = fake_quantize(out, form, None, fake.fp8)
            result = (q["quant"], res_out, q["scale"])
            return result + (out,) if emit_bf16 else result

        def custom_fused_ar_rms_quant(self, input, residual_inp, weight, eps, use_1stage,
                                      gemma_norm=False, emit_bf16=False):
            return quantized("fp8_dynamic", input, residual_inp, weight, eps, gemma_norm, emit_bf16)

        def custom_fused_ar_rms_per_group_quant(self, input, residual_inp, weight, eps, group_size=128,
                                                use_1stage=False, emit_bf16=False):
            return quantized("fp8_group", input, residual_inp, weight, eps, False, emit_bf16)

        def close(self):
            return None

        return {name: fn for name, fn in locals().items() if callable(fn) and hasattr(
            SIGNATURES[fake.version], name) and name not in ("add_norm", "quantized")}

    def _checked(self, name: str, impl: Callable) -> Callable:
        """Bind each call against aiter's documented signature before running the fake."""
        stub = getattr(SIGNATURES[self.version], name)
        signature = inspect.signature(stub)

        @functools.wraps(stub)
        def method(obj, *args, **kwargs):
            self.calls.append((name, args, kwargs))
            try:
                signature.bind(obj, *args, **kwargs)
            except TypeError as e:
                self.violations.append(f"{name}: {e}")
                raise
            mode = self.behaviour.get(name, "ok")
            if mode == "raise":
                raise RuntimeError(f"fake {name} failure")
            if obj.disabled or mode == "none":
                return None
            return impl(obj, *args, **kwargs)

        return method

    def custom_all_reduce_class(self) -> type:
        fake = self
        stub_init = inspect.signature(SIGNATURES[self.version].__init__)

        def __init__(obj, *args, **kwargs):
            fake.calls.append(("__init__", args, kwargs))
            try:
                stub_init.bind(obj, *args, **kwargs)
            except TypeError as e:
                fake.violations.append(f"__init__: {e}")
                raise
            if fake.ctor_raises:
                raise AssertionError("fake set-up failure")
            obj.disabled = fake.disabled
            obj.world_size = fake.world_size
            fake.instances.append(obj)

        namespace = {"__init__": functools.wraps(SIGNATURES[self.version].__init__)(__init__)}
        for name, impl in self._kernels().items():
            namespace[name] = self._checked(name, impl)
        return type("CustomAllreduce", (), namespace)

    def modules(self) -> dict[str, types.ModuleType]:
        """sys.modules entries for `aiter` and the submodules arfusion reads."""
        def module(name: str, **attrs) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            m.__dict__.update(attrs)
            return m

        custom_ar = module("aiter.dist.device_communicators.custom_all_reduce",
                           CustomAllreduce=self.custom_all_reduce_class())
        if self.version == V_MAIN:
            custom_ar.IPCBufferPool = type("IPCBufferPool", (), {})
        dtypes = module("aiter.utility.dtypes", fp8=self.fp8)
        return {
            "aiter": module("aiter", __version__=self.version),
            "aiter.utility": module("aiter.utility", dtypes=dtypes),
            "aiter.utility.dtypes": dtypes,
            "aiter.dist": module("aiter.dist"),
            "aiter.dist.device_communicators": module("aiter.dist.device_communicators"),
            "aiter.dist.device_communicators.custom_all_reduce": custom_ar,
        }

    def install(self, monkeypatch) -> None:
        for name, m in self.modules().items():
            monkeypatch.setitem(sys.modules, name, m)
