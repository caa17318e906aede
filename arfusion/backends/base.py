"""What a backend is: a capability table plus a run function.

Every fusion decision goes through `Backend.why_not(call)`, at compile time (static shapes)
and again at run time inside the fused op. It only reads values that are identical on
every rank of the group (shapes, dtypes, world size, config), so all ranks take the same
path and a collective kernel is never entered by only some of them.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# Norm forms, with norm(x) the fp32 normalisation: "rms" is y = w * norm(x).to(dtype) (HF Llama,
# Qwen, Mistral: rounded before the weight multiply), "rms_fp32_weight" is
# y = (norm(x) * w.float()).to(dtype) (OLMo2, torch.nn.RMSNorm: one rounding, as the fused
# kernels compute), "gemma_rms" is y = (norm(x) * (1 + w.float())).to(dtype).
NORM_FORMS = ("rms", "rms_fp32_weight", "gemma_rms")


@dataclass(frozen=True)
class Site:
    """What one fused site computes; fixed when the pattern is rewritten."""

    residual: bool  # an add of a residual precedes the norm
    norm: str  # one of NORM_FORMS
    quant: str = "none"  # "none" or one of config.QUANT_FORMS
    emit_norm: bool = True  # the unquantized norm output is produced too

    @property
    def name(self) -> str:
        """Pattern name as shown in stats: says what is fused."""
        parts = ["allreduce", "add" if self.residual else None, self.norm.replace("rms", "rmsnorm")]
        if self.quant != "none":
            parts.append(self.quant + ("_with_norm_out" if self.emit_norm else ""))
        return "_".join(p for p in parts if p)

    def outputs(self) -> tuple[str, ...]:
        """Names of the fused op's outputs, in order: the one place that fixes the indices."""
        outs = ["residual"]
        if self.emit_norm:
            outs.append("norm")
        if self.quant != "none":
            outs.append("quant")
            if self.quant != "fp8_static":
                outs.append("scale")
        return tuple(outs)


@dataclass(frozen=True)
class Call:
    """One invocation of a fused site. `tokens` is None while unknown (symbolic at compile time)."""

    site: Site
    tokens: int | None
    hidden: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    world_size: int
    device: torch.device
    group_name: str = ""
    input_scaled: bool = False  # x is multiplied by a number first: one more pass where a kernel runs

    @property
    def nbytes(self) -> int | None:
        """Bytes of the per-rank input."""
        if self.tokens is None:
            return None
        return self.tokens * self.hidden * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Capabilities:
    """The static part of what a backend supports. Empty `world_sizes` means any."""

    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    norms: frozenset[str] = frozenset(NORM_FORMS)
    quants: frozenset[str] = frozenset({"none"})
    world_sizes: frozenset[int] = frozenset()
    residual_optional: bool = True
    quantized_levels: frozenset[str] = frozenset()  # config.QUANTIZED_LEVELS it has an all-reduce for
    # The fused MoE kernel is safe only with another collective on its group between two of its
    # calls, and the pass can vouch for that only inside one graph (FlashInfer's finalize kernel:
    # FinalizeWorkspaces in flashinfer.py).
    moe_combine_needs_other_collective: bool = False

    def why_not(self, call: Call) -> str | None:
        site = call.site
        if call.device.type not in self.device_types:
            return f"device {call.device.type} not in {sorted(self.device_types)}"
        if call.dtype not in self.dtypes:
            return f"dtype {call.dtype} not supported"
        if site.norm not in self.norms:
            return f"norm form {site.norm} not supported"
        if site.quant not in self.quants:
            return f"quant form {site.quant} not supported"
        if self.world_sizes and call.world_size not in self.world_sizes:
            return f"world size {call.world_size} not in {sorted(self.world_sizes)}"
        if not site.residual and not self.residual_optional:
            return "needs a residual"
        return None


@dataclass
class Backend:
    """Base class. Subclasses set `name`, `capabilities` and implement `run`.

    Optional hooks: `unavailable(device)` says why the backend cannot run on this machine
    (missing package, wrong GPU); `shape_check(call)` adds backend-specific shape rules;
    `default_max_bytes(call)` is the backend's own size cap (inclusive; None: unlimited);
    `prepare(call, max_bytes_override)` readies run-time resources.
    """

    name: str = "base"
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(frozenset(), frozenset()))

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def shape_check(self, call: Call) -> str | None:
        return None

    def default_max_bytes(self, call: Call) -> int | None:
        return None

    def why_not(self, call: Call, max_bytes_override: int | None = None) -> str | None:
        """None if this call may be fused by this backend, else the reason it may not."""
        reason = (self.capabilities.why_not(call) or self.unavailable(call.device)
                  or self.shape_check(call))
        if reason:
            return reason
        cap = max_bytes_override if max_bytes_override is not None else self.default_max_bytes(call)
        if cap is not None and call.nbytes is not None and call.nbytes > cap:
            return f"{call.nbytes} bytes per rank > cap {cap}"
        return None

    def prepare(self, call: Call, max_bytes_override: int | None = None) -> str | None:
        """Run time only, after `why_not` accepted the call: get what the kernel needs (e.g. a
        workspace, created collectively). None when ready, else why not. The pass never calls
        it, so nothing here may be assumed to exist when a compiled graph is loaded from cache."""
        return None

    def fingerprint(self) -> str:
        """Anything outside the source code that changes decisions (versions, tuned tables)."""
        return ""

    def run(self, call: Call, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, quant_scale: torch.Tensor | None) -> Sequence[torch.Tensor]:
        """Compute the fused result; return tensors in `call.site.outputs()` order."""
        raise NotImplementedError

    def run_scaled(self, call: Call, x: torch.Tensor, input_scale: float | torch.Tensor,
                   residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   quant_scale: torch.Tensor | None) -> Sequence[torch.Tensor]:
        """`run` of all_reduce(x) * input_scale: a kernel takes x * input_scale (the same on every
        rank, so the same sum up to rounding); a backend that can scale after the all-reduce, as
        the graph does, overrides this."""
        return self.run(call, x * input_scale, residual, weight, eps, quant_scale)

    # MoE top-k combine + all-reduce + residual + RMSNorm (`arfusion::moe_combine_allreduce_rmsnorm`).
    # A backend without such a kernel says why not; the op then combines in torch and runs the
    # ordinary fused site (`run` above), and the pass leaves the combine to Inductor where the
    # token count is known at compile time.

    def moe_combine_why_not(self, call: Call, top_k: int, rows: int | None) -> str | None:
        """None if this backend computes combine + site in one go for `call` (tokens None:
        unknown until run time), else why not. Same-on-every-rank facts only."""
        return f"backend {self.name} has no fused MoE-combine kernel"

    def prepare_moe_combine(self, call: Call) -> str | None:
        """`prepare` for the fused MoE kernel, after `prepare` (run time, collective where it makes
        anything): None when ready, else why not."""
        return None

    def run_moe_combine(self, call: Call, rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                        top_k: int, scale_first: bool, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, quant_scale: torch.Tensor | None, shared: torch.Tensor | None = None,
                        routed_scale: float = 1.0, input_scale: float = 1.0) -> Sequence[torch.Tensor]:
        """The fused result from the combine's inputs (see `reference.moe_combine`: the combine times
        `routed_scale`, plus `shared` [T, H], all-reduced, times `input_scale`); outputs in
        `call.site.outputs()` order, [T, H]."""
        raise NotImplementedError

    # Quantized all-reduce (opt-in, lossy; arfusion/quantized_comm.py): the op runs it, then the
    # compiled add+RMSNorm(+quant), where `quantized_why_not` accepts the call. The crossover
    # (`quantized_min_bytes`) is where it beats the exact path this backend would take; the
    # checks read same-on-every-rank facts only, like `why_not`.

    def quantized_min_bytes(self, call: Call, level: str) -> tuple[int | None, str]:
        """(per-rank bytes from which `level` pays here, inclusive, or None: not known; source)."""
        return None, f"no measured crossover for a {level} all-reduce on backend {self.name}"

    def quantized_problem(self, call: Call, level: str) -> str | None:
        """Backend-specific reasons the quantized kernel cannot take `call` (dtype, world, GPU)."""
        return None

    def quantized_why_not(self, call: Call, level: str, min_bytes_override: int | None = None) -> str | None:
        """None if `call` runs a `level` quantized all-reduce (tokens None: decided at run time)."""
        if level not in self.capabilities.quantized_levels:
            return f"backend {self.name} has no {level} quantized all-reduce"
        if call.device.type not in self.capabilities.device_types:
            return f"device {call.device.type} not in {sorted(self.capabilities.device_types)}"
        reason = self.unavailable(call.device) or self.quantized_problem(call, level)
        if reason:
            return reason
        if min_bytes_override is not None:
            floor, source = min_bytes_override, "quantized_allreduce_min_mb"
        else:
            floor, source = self.quantized_min_bytes(call, level)
            if floor is None:
                return source
        if call.nbytes is not None and call.nbytes < floor:
            return f"{call.nbytes} bytes per rank < {floor} ({source}): the exact path is faster"
        return None

    def prepare_quantized(self, call: Call, level: str) -> str | None:
        """Run time only, after `quantized_why_not` accepted: ready the kernel's buffers
        (collectively, outside CUDA-graph pools, never during capture). None when ready."""
        return None

    def quantized_all_reduce(self, call: Call, x: torch.Tensor, level: str) -> torch.Tensor:
        """The sum over the group of `x` ([T, H], contiguous), sent as `level`."""
        raise NotImplementedError


def flatten_tokens(t: torch.Tensor) -> torch.Tensor:
    """2-D contiguous [tokens, hidden] view, as fused kernels want."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def num_tokens(shape: Sequence[int]) -> int:
    return math.prod(shape[:-1])


def outside_graph_pools(device: torch.device, create: Callable[[], T]) -> T:
    """create() with its allocations in the ordinary pool: for what outlives a call (workspaces,
    a cached zero residual).

    During the eager warm-up of torch.compile(mode="reduce-overhead"), cudagraph trees send every
    allocation made by the current *thread* (any stream) to the graph's private pool, and later
    refuse to run while tensors they do not track live there ("tensor(s) in the cudagraph pool
    not tracked as outputs"; seen on 2xH200 and 4xH200). So create() runs on a helper thread,
    with the caller blocked until it is done.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return create()
    caller_stream = torch.cuda.current_stream(device)

    def on_device() -> T:
        torch.cuda.set_device(device)  # a new thread starts on device 0
        side = torch.cuda.Stream(device)
        side.wait_stream(caller_stream)
        with torch.cuda.stream(side):
            made = create()
        side.synchronize()  # once per workspace: the caller may use it on any stream
        return made

    return on_helper_thread(on_device)


def on_helper_thread(fn: Callable[[], T]) -> T:
    """fn() on a fresh thread while this one waits; its result, or its exception re-raised here."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # handed to the caller
            outcome["error"] = e

    thread = threading.Thread(target=target, name="arfusion-outside-graph-pools")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def hash63(text: str) -> int:
    """A stable integer that fits an int64 tensor, to compare strings across ranks."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def all_ranks_agree(ok: bool, group, device: torch.device = torch.device("cpu")) -> bool:
    """True on every rank if `ok` is true on every rank of `group` (a collective; `device` is
    where the group's backend communicates: the GPU for NCCL, the CPU for gloo)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def resolve_group(group_name: str):
    """The live ProcessGroup of that name, or None (no such group: unit tests' made-up names)."""
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except RuntimeError:
        return None


def group_is_live(group) -> bool:
    """False once destroy_process_group has removed `group` (its object may still be held)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


class PerGroup(dict):
    """Backend state per process group, looked up by the group's name.

    Names are handed out again: destroy_process_group + init_process_group make a new "0" with
    other peers, and a graph compiled before resolves the name when it runs. State made for the
    old group (buffers opened from the old peers' IPC handles) would then reduce with the old
    peers, silently. So each entry remembers the ProcessGroup it was made for, and a name that
    now resolves to another one gets fresh state; the replaced entry moves to `stale` (graphs
    captured earlier may still point into its buffers) and is freed with the rest at close().
    """

    def __init__(self, make: Callable[[], Any], resolve: Callable[[str], Any] = resolve_group):
        super().__init__()
        self.make, self.resolve = make, resolve
        self.stale: list = []
        self._made_for: dict[str, Any] = {}

    def current(self, group_name: str):
        """The state of the group the name resolves to now; made on first use."""
        group = self.resolve(group_name)
        if group_name in self and self._made_for[group_name] != group:  # ProcessGroup: by identity
            self.stale.append(self.pop(group_name))
        if group_name not in self:
            self[group_name] = self.make()
            self._made_for[group_name] = group
        return self[group_name]

    def everything(self) -> list:
        """Current and stale states: what close() frees."""
        return [*self.values(), *self.stale]

    def clear(self) -> None:
        super().clear()
        self.stale.clear()
        self._made_for.clear()
