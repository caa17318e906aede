"""A stand-in for aiter's custom all-reduce, written from aiter's documented signatures.

It checks arfusion's side of the contract (argument names, positional order, return order,
None when disabled) and computes results on the CPU with arfusion's own reference math, so
nothing here says anything about aiter's kernels.

The signatures below are aiter's, copied as signatures only (names, order, defaults) from:
  V017:  amd-aiter 0.1.7.post2.dev18 (PyPI), aiter/dist/device_communicators/custom_all_reduce.py
  V_STAGE: ROCm/aiter commit 86a98ee, same file (use_1stage added, return order flipped)
  V_MAIN: ROCm/aiter main commit e404860 (2026-08-22), same file (gemma_norm, quant variants,
         IPCBufferPool, the AITER_CUSTOM_AR_MIN_SIZE / AITER_CUSTOM_AR_MAX_SIZE window of
         aiter#4233); its version string is what setuptools_scm gives a build of that commit.
         Commit 03644e5 (2026-07-24, read before) has the same signatures but for
         `transpose_scale`, and 1-stage kernels without aiter#4346's closing barrier.
Every `custom_*` method returns None where aiter's `should_custom_ar(input)` says no (see
`custom_ar_fits`, this file's own code written from those versions' rules).

The quick all-reduce ("quickreduce") ops and its communicator module, likewise signatures only:
  V017:  the 0.1.7.post2.dev18 wheel, aiter/ops/quick_all_reduce.py (star-imported into `aiter`)
         and aiter/dist/device_communicators/quick_all_reduce.py (QuickReduceRegime)
  V_MAIN: ROCm/aiter main (read at 4f5c2ba, 0c3e72b and e404860), the same two files; the fake's
         qr_exchange_handles does what main's does (the code is this file's own)
  V_STAGE: not read for the quick all-reduce, so the fake gives that version none.

At the end, what tests/test_aiter_backend.py and tests/test_aiter_quick_reduce.py share:
`simulate_rocm` (a ROCm torch build with one GPU of a given arch, the fake installed) and `call`
(a fused site's call on that GPU, CUDA, over the group GROUP).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib.machinery
import inspect
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from arfusion import reference
from arfusion.backends.aiter import limits
from arfusion.core import Call, Form

V017, V_STAGE, V_MAIN = "0.1.7.post2.dev18", "0.1.9+g86a98ee", "0.1.21.dev46+ge4048607a5"


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
                                            use_1stage=False, emit_bf16=False, transpose_scale=False): ...
    def close(self): ...


SIGNATURES = {V017: _Sig017, V_STAGE: _SigStage, V_MAIN: _SigMain}
NORM_FIRST = {V017: False, V_STAGE: True, V_MAIN: True}


# Module-level ops of `aiter` (aiter/ops/quick_all_reduce.py), per version.
class _QrOps017:
    @staticmethod
    def init_custom_qr(rank, world_size, qr_max_size=None): ...  # -> int (the DeviceComms pointer)
    @staticmethod
    def qr_destroy(fa): ...
    @staticmethod
    def qr_all_reduce(fa, inp, out, quant_level, cast_bf2half=False): ...
    @staticmethod
    def qr_get_handle(fa): ...  # -> uint8 CPU tensor, sizeof(hipIpcMemHandle_t) = 64 bytes
    @staticmethod
    def qr_open_handles(fa, handles): ...  # handles: list[Tensor], one per rank in rank order
    @staticmethod
    def qr_max_size(): ...  # -> int


class _QrOpsMain(_QrOps017):
    @staticmethod
    def qr_get_handle(fa, out_ptr): ...  # writes the 64-byte handle at host address out_ptr
    @staticmethod
    def qr_open_handles(fa, handle_ptrs): ...  # handle_ptrs: list[int], host addresses in rank order


QR_SIGNATURES = {V017: _QrOps017, V_MAIN: _QrOpsMain}
# aiter.dist.device_communicators.quick_all_reduce.QuickReduceRegime
QR_REGIMES = {
    V017: {"FP": 0, "FP8": 1, "INT6": 2, "INT4": 3, "NONE": 4},
    V_MAIN: {"FP": 0, "FP8": 1, "INT6": 2, "INT4": 3, "INT3": 4, "NONE": 5},
}
QR_HANDLE_BYTES = 64
QR_DEFAULT_MAX = 2 ** 31  # qr_max_size(): INT32_MAX + 1
_QR_MAGIC = 0xA7


def qr_handle(rank: int, world_size: int) -> torch.Tensor:
    """The fake IPC handle of a rank's buffer: 64 bytes that name the rank."""
    handle = torch.zeros(QR_HANDLE_BYTES, dtype=torch.uint8)
    handle[:3] = torch.tensor([_QR_MAGIC, rank, world_size], dtype=torch.uint8)
    return handle


def qr_handle_owner(raw: bytes) -> tuple[int, int] | None:
    """(rank, world size) a fake handle names, or None for anything else."""
    return (raw[1], raw[2]) if len(raw) == QR_HANDLE_BYTES and raw[0] == _QR_MAGIC else None


# --- which inputs CustomAllreduce's custom_* methods take (should_custom_ar) ----------------

CAR_DEFAULT_MAX = 8192 * 8192  # aiter's _DEFAULT_CAR_MAX_SIZE (64 MiB)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def car_window(max_size: int) -> tuple[int, int]:
    """V_MAIN's (min, max] window, read at construction as aiter's _resolve_car_min_size and
    _resolve_car_max_size(pool_size=max_size) do: min unset, bad or negative -> 0; max unset, bad
    or negative -> 64 MiB, 0 -> 0 (off), above the pool -> 64 MiB."""
    low = _env_int("AITER_CUSTOM_AR_MIN_SIZE")
    high = _env_int("AITER_CUSTOM_AR_MAX_SIZE")
    low = 0 if low is None or low < 0 else low
    if high is None or high < 0 or high > max_size:
        high = CAR_DEFAULT_MAX
    return low, high


def custom_ar_fits(version: str, obj: Any, inp: torch.Tensor) -> bool:
    """aiter's should_custom_ar(inp) for a communicator that is not disabled (world 2 or fully
    connected, which aiter's ROCm code always assumes): bytes a multiple of 16, dense, and
    V017 / V_STAGE: bytes <= max_size; V_MAIN: min < bytes <= max (car_window)."""
    nbytes = inp.numel() * inp.element_size()
    if nbytes % 16 or not inp.is_contiguous():
        return False
    if version == V_MAIN:
        low, high = obj.car_window
        return high > 0 and low < nbytes <= high
    return nbytes <= obj.max_size


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
    results: list[tuple[str, Any]] = field(default_factory=list)  # what each CustomAllreduce method returned
    violations: list[str] = field(default_factory=list)
    instances: list[Any] = field(default_factory=list)
    quick_reduce: bool = True  # give the versions that have one their quick all-reduce
    qr_comms: dict[int, dict] = field(default_factory=dict)  # pointer -> the fake DeviceComms

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
                                                use_1stage=False, emit_bf16=False, transpose_scale=False):
            fake._contract(not transpose_scale, "custom_fused_ar_rms_per_group_quant: arfusion reads a "
                                                "row-major scale (transpose_scale=False)")
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
            fits = not name.startswith("custom_") or custom_ar_fits(
                self.version, obj, args[0] if args else kwargs["input"])
            if obj.disabled or mode == "none" or not fits:
                result = None
            else:
                result = impl(obj, *args, **kwargs)
            self.results.append((name, result))
            return result

        return method

    def custom_all_reduce_class(self) -> type:
        fake = self
        stub_init = inspect.signature(SIGNATURES[self.version].__init__)

        def __init__(obj, *args, **kwargs):
            fake.calls.append(("__init__", args, kwargs))
            try:
                bound = stub_init.bind(obj, *args, **kwargs)
            except TypeError as e:
                fake.violations.append(f"__init__: {e}")
                raise
            if fake.ctor_raises:
                raise AssertionError("fake set-up failure")
            bound.apply_defaults()
            obj.max_size = bound.arguments["max_size"]
            obj.car_window = car_window(obj.max_size)  # read here, as aiter's __init__ does
            obj.disabled = fake.disabled
            obj.world_size = fake.world_size
            fake.instances.append(obj)

        namespace = {"__init__": functools.wraps(SIGNATURES[self.version].__init__)(__init__)}
        for name, impl in self._kernels().items():
            namespace[name] = self._checked(name, impl)
        return type("CustomAllreduce", (), namespace)

    # ---- quick all-reduce: module-level ops, checked like aiter's own wrapper and kernel do

    def _contract(self, ok: bool, message: str) -> None:
        if not ok:
            self.violations.append(message)
            raise TypeError(message)

    def _qr_comm(self, name: str, fa: Any, opened: bool = True) -> dict:
        comm = self.qr_comms.get(fa) if isinstance(fa, int) else None
        self._contract(comm is not None and not comm["destroyed"], f"{name}: {fa!r} is no live quick all-reduce")
        self._contract(comm["opened"] or not opened, f"{name}: peer buffers were never opened")
        return comm

    def _qr_open(self, name: str, comm: dict, raws: list[bytes]) -> None:
        owners = [qr_handle_owner(raw) for raw in raws]
        expected = [(r, comm["world"]) for r in range(comm["world"])]
        self._contract(owners == expected, f"{name}: handles name {owners}, expected {expected} (rank order)")
        comm["opened"] = True

    def _qr_ops(self) -> dict[str, Callable]:
        fake, ints = self, lambda *v: all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        regimes = QR_REGIMES[self.version]

        def init_custom_qr(rank, world_size, qr_max_size=None):
            fake._contract(ints(rank, world_size), "init_custom_qr: rank and world_size must be ints")
            fake._contract(qr_max_size is None or ints(qr_max_size), "init_custom_qr: qr_max_size: int or None")
            if world_size > 8 or world_size == 6 or world_size % 2 or not 0 <= rank < world_size:
                raise ValueError(f"init_custom_qr: rank {rank} of world size {world_size} not supported")
            ptr = 0x7F0000001000 + 0x1000 * len(fake.qr_comms)
            fake.qr_comms[ptr] = {"rank": rank, "world": world_size, "opened": False, "destroyed": False,
                                  "max": qr_max_size if qr_max_size and qr_max_size > 0 else QR_DEFAULT_MAX}
            return ptr

        def qr_destroy(fa):
            fake._qr_comm("qr_destroy", fa, opened=False)["destroyed"] = True

        def qr_all_reduce(fa, inp, out, quant_level, cast_bf2half=False):
            comm = fake._qr_comm("qr_all_reduce", fa)
            fake._contract(ints(quant_level) and quant_level in regimes.values() and quant_level != regimes["NONE"],
                           f"qr_all_reduce: quant_level must be a QuickReduceRegime value as int, got {quant_level!r}")
            fake._contract(isinstance(cast_bf2half, bool),
                           f"qr_all_reduce: cast_bf2half must be bool, got {cast_bf2half!r}")
            fake._contract(inp.dtype == out.dtype and inp.numel() == out.numel(), "qr_all_reduce: inp/out differ")
            fake._contract(inp.dtype in (torch.float16, torch.bfloat16), f"qr_all_reduce: dtype {inp.dtype}")
            nbytes = inp.numel() * inp.element_size()
            fake._contract(0 < nbytes <= comm["max"] and nbytes % 16 == 0, f"qr_all_reduce: {nbytes} bytes")
            out.copy_(fake.reduce(inp).view(out.shape))

        def qr_get_handle(fa, out_ptr=None):
            comm = fake._qr_comm("qr_get_handle", fa, opened=False)
            handle = qr_handle(comm["rank"], comm["world"])
            if fake.version == V017:
                return handle
            fake._contract(ints(out_ptr), "qr_get_handle: out_ptr must be a host address (int)")
            ctypes.memmove(out_ptr, bytes(handle.tolist()), QR_HANDLE_BYTES)

        def qr_open_handles(fa, handles):
            comm = fake._qr_comm("qr_open_handles", fa, opened=False)
            fake._contract(isinstance(handles, list), "qr_open_handles: needs a list")
            if fake.version == V017:
                fake._contract(all(isinstance(h, torch.Tensor) for h in handles), "qr_open_handles: tensors")
                raws = [bytes(h.tolist()) for h in handles]
            else:
                fake._contract(ints(*handles), "qr_open_handles: host addresses (ints)")
                raws = [ctypes.string_at(h, QR_HANDLE_BYTES) for h in handles]
            fake._qr_open("qr_open_handles", comm, raws)

        def qr_max_size():
            return QR_DEFAULT_MAX

        return {"init_custom_qr": init_custom_qr, "qr_destroy": qr_destroy, "qr_all_reduce": qr_all_reduce,
                "qr_get_handle": qr_get_handle, "qr_open_handles": qr_open_handles, "qr_max_size": qr_max_size}

    def _checked_function(self, name: str, impl: Callable) -> Callable:
        """A module-level op bound against its documented signature before the fake runs."""
        stub = getattr(QR_SIGNATURES[self.version], name)
        signature = inspect.signature(stub)

        @functools.wraps(stub)
        def op(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            try:
                signature.bind(*args, **kwargs)
            except TypeError as e:
                self.violations.append(f"{name}: {e}")
                raise
            if self.behaviour.get(name) == "raise":
                raise RuntimeError(f"fake {name} failure")
            return impl(*args, **kwargs)

        return op

    def qr_exchange_handles(self, ptr, world_size, group):
        """main's helper: this rank's handle into a 64-byte host tensor, gathered as objects over
        `group`, then every rank's buffer opened by the gathered tensors' host addresses."""
        self.calls.append(("qr_exchange_handles", (ptr, world_size, group), {}))
        ops = sys.modules["aiter"]
        mine = torch.empty(QR_HANDLE_BYTES, dtype=torch.uint8, device="cpu")
        ops.qr_get_handle(ptr, mine.data_ptr())
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, mine, group=group)
        ops.qr_open_handles(ptr, [t.data_ptr() for t in gathered])

    def simulated_all_gather_object(self, out: list, obj: Any, group=None) -> None:
        """dist.all_gather_object for one process standing in for the whole group: the other
        ranks' entries are their fake handles."""
        self.calls.append(("all_gather_object", (len(out), group), {}))
        rank, world = qr_handle_owner(bytes(obj.tolist()))
        for i in range(len(out)):
            out[i] = obj if i == rank else qr_handle(i, world)

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
        found = {
            "aiter": module("aiter", __version__=self.version),
            "aiter.utility": module("aiter.utility", dtypes=dtypes),
            "aiter.utility.dtypes": dtypes,
            "aiter.dist": module("aiter.dist"),
            "aiter.dist.device_communicators": module("aiter.dist.device_communicators"),
            "aiter.dist.device_communicators.custom_all_reduce": custom_ar,
        }
        if self.quick_reduce and self.version in QR_SIGNATURES:
            for name, impl in self._qr_ops().items():
                setattr(found["aiter"], name, self._checked_function(name, impl))
            qr = module("aiter.dist.device_communicators.quick_all_reduce",
                        QuickReduceRegime=enum.Enum("QuickReduceRegime", QR_REGIMES[self.version]))
            if self.version == V_MAIN:
                qr.qr_exchange_handles = self.qr_exchange_handles
            found[qr.__name__] = qr
        return found

    def install(self, monkeypatch) -> None:
        for name, m in self.modules().items():
            monkeypatch.setitem(sys.modules, name, m)


# --- a simulated ROCm machine, as the aiter backend's tests set it up -----------------------

CUDA = torch.device("cuda", 0)
GROUP = "tp0"


def simulate_rocm(monkeypatch, arch: str = "gfx942", fake: FakeAiter | None = None) -> FakeAiter:
    """A ROCm torch build with one GPU of `arch` and (fake) aiter installed."""
    fake = fake or FakeAiter(fp8=limits.LIMITS.fp8_dtypes.get(arch, torch.float8_e4m3fn))
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake.install(monkeypatch)
    return fake


def call(tokens=4, hidden=4096, world_size=2, dtype=torch.bfloat16, weight_dtype=None, residual=True,
         norm="rms", quant_form="none", emit_norm=True) -> Call:
    """A fused site's call on that machine's GPU (CUDA), over the group GROUP."""
    site = Form(residual=residual, norm=norm, quant=quant_form, emit_norm=emit_norm)
    return Call(form=site, tokens=tokens, hidden=hidden, dtype=dtype,
                weight_dtype=weight_dtype or dtype, world_size=world_size, device=CUDA,
                group_name=GROUP)
