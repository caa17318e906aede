"""What a backend is: a capability table plus a run function.

Every fusion decision goes through `Backend.why_not(call)`, at compile time (static shapes)
and again at run time inside the fused op. It only reads values that are identical on
every rank of the group (shapes, dtypes, world size, config), so all ranks take the same
path and a collective kernel is never entered by only some of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..core import NORM_FORMS, Call
from ..decisions import Reason, Why


_tables = [0]  # bumped whenever a backend's dispatch tables may have changed


def tables_changed() -> None:
    """A backend's tables were re-read (a tuned cache written in this process): decisions made
    from the old ones, and remembered by call signature (execution.py), are forgotten."""
    _tables[0] += 1


def tables_version() -> int:
    return _tables[0]


@dataclass(frozen=True)
class Capabilities:
    """The static part of what a backend supports. Empty `world_sizes` means any."""

    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    norms: frozenset[str] = frozenset(NORM_FORMS)
    quants: frozenset[str] = frozenset({"none"})
    world_sizes: frozenset[int] = frozenset()
    residual_optional: bool = True
    codecs: frozenset[str] = frozenset()  # config.QUANTIZED_LEVELS it has an all-reduce for
    # The fused MoE kernel is safe only with another collective on its group between two of its
    # calls, and the pass can vouch for that only inside one graph (FlashInfer's finalize kernel:
    # FinalizeWorkspaces in flashinfer.py).
    moe_combine_needs_other_collective: bool = False

    def why_not(self, call: Call) -> Reason | None:
        form = call.form
        if form.norm not in self.norms:
            return Reason(Why.NORM_FORM, f"norm form {form.norm} not supported")
        if form.quant not in self.quants:
            return Reason(Why.QUANT_FORM, f"quant form {form.quant} not supported")
        if not form.residual and not self.residual_optional:
            return Reason(Why.NEEDS_RESIDUAL, "needs a residual")
        return self.why_not_plain(call)

    def why_not_plain(self, call: Call) -> Reason | None:
        """The checks every call meets, a plain all-reduce's too (it has no norm or quant form)."""
        if call.device.type not in self.device_types:
            return Reason(Why.DEVICE, f"device {call.device.type} not in {sorted(self.device_types)}")
        if call.dtype not in self.dtypes:
            return Reason(Why.DTYPE, f"dtype {call.dtype} not supported")
        if self.world_sizes and call.world_size not in self.world_sizes:
            return Reason(Why.WORLD_SIZE, f"world size {call.world_size} not in {sorted(self.world_sizes)}")
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

    def unavailable(self, device: torch.device) -> Reason | None:
        return None

    def shape_check(self, call: Call) -> Reason | None:
        return None

    def default_max_bytes(self, call: Call) -> int | None:
        return None

    def why_not(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        """None if this call may be fused by this backend, else the reason it may not."""
        reason = (self.capabilities.why_not(call) or self.unavailable(call.device)
                  or self.shape_check(call))
        if reason:
            return reason
        cap = max_bytes_override if max_bytes_override is not None else self.default_max_bytes(call)
        return over_cap(call, cap, "the backend's cap" if max_bytes_override is None else "the configured max_size_mb")

    def prepare(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        """Run time only, after `why_not` accepted the call: get what the kernel needs (e.g. a
        workspace, created collectively). None when ready, else why not. The pass never calls
        it, so nothing here may be assumed to exist when a compiled graph is loaded from cache."""
        return None

    def fingerprint(self) -> str:
        """Anything outside the source code that changes decisions (versions, tuned tables)."""
        return ""

    def run(self, call: Call, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, quant_scale: torch.Tensor | None) -> Sequence[torch.Tensor]:
        """Compute the fused result; return tensors in `call.form.outputs()` order."""
        raise NotImplementedError

    def bind(self, call: Call) -> Callable[..., Any] | None:
        """After `prepare` and `run` (or `prepare_plain` and `all_reduce`: `call.form` is PLAIN)
        succeeded for `call`: the same for later calls of its signature (shape, dtypes, group) with
        all but the tensors worked out once, as fn(x, residual, weight, eps) -> outputs dense in x's
        shape (fn(x) -> the sum, for PLAIN), or None once what it was bound to is gone (the caller
        then prepares and binds again). None: no such shortcut. Outside CUDA-graph replays every
        call pays its backend's host path on every step."""
        return None

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

    def moe_combine_why_not(self, call: Call, top_k: int, rows: int | None) -> Reason | None:
        """None if this backend computes combine + site in one go for `call` (tokens None:
        unknown until run time), else why not. Same-on-every-rank facts only."""
        return Reason(Why.NO_KERNEL, f"backend {self.name} has no fused MoE-combine kernel")

    def prepare_moe_combine(self, call: Call) -> Reason | None:
        """`prepare` for the fused MoE kernel, after `prepare` (run time, collective where it makes
        anything): None when ready, else why not."""
        return None

    def run_moe_combine(self, call: Call, rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                        top_k: int, scale_first: bool, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, quant_scale: torch.Tensor | None, shared: torch.Tensor | None = None,
                        routed_scale: float = 1.0, input_scale: float = 1.0) -> Sequence[torch.Tensor]:
        """The fused result from the combine's inputs (see `reference.moe_combine`: the combine times
        `routed_scale`, plus `shared` [T, H], all-reduced, times `input_scale`); outputs in
        `call.form.outputs()` order, [T, H]."""
        raise NotImplementedError

    # Quantized all-reduce (opt-in, lossy; arfusion/codec.py): the op runs it, then the
    # compiled add+RMSNorm(+quant), where `codec_why_not` accepts the call. The crossover
    # (`codec_min_bytes`) is where it beats the exact path this backend would take; the
    # checks read same-on-every-rank facts only, like `why_not`.

    def codec_min_bytes(self, call: Call, level: str) -> tuple[int | None, str]:
        """(per-rank bytes from which `level` pays here, inclusive, or None: not known; source)."""
        return None, f"no measured crossover for a {level} all-reduce on backend {self.name}"

    def codec_problem(self, call: Call, level: str) -> Reason | None:
        """Backend-specific reasons the quantized kernel cannot take `call` (dtype, world, GPU)."""
        return None

    def codec_why_not(self, call: Call, level: str, min_bytes_override: int | None = None) -> Reason | None:
        """None if `call` runs a `level` quantized all-reduce (tokens None: decided at run time)."""
        if level not in self.capabilities.codecs:
            return Reason(Why.NO_KERNEL, f"backend {self.name} has no {level} quantized all-reduce")
        if call.device.type not in self.capabilities.device_types:
            return Reason(Why.DEVICE, f"device {call.device.type} not in {sorted(self.capabilities.device_types)}")
        reason = self.unavailable(call.device) or self.codec_problem(call, level)
        if reason:
            return reason
        if min_bytes_override is not None:
            floor, source = min_bytes_override, "quantized_allreduce_min_mb"
        else:
            floor, source = self.codec_min_bytes(call, level)
            if floor is None:
                return Reason(Why.NO_CROSSOVER, source)
        if call.nbytes is not None and call.nbytes < floor:
            return Reason(Why.BELOW_CROSSOVER,
                          f"{call.nbytes} bytes per rank < {floor} ({source}): the exact path is faster")
        return None

    def prepare_codec(self, call: Call, level: str) -> Reason | None:
        """Run time only, after `codec_why_not` accepted: ready the kernel's buffers
        (collectively, outside CUDA-graph pools, never during capture). None when ready."""
        return None

    def codec_all_reduce(self, call: Call, x: torch.Tensor, level: str) -> torch.Tensor:
        """The sum over the group of `x` ([T, H], contiguous), sent as `level`."""
        raise NotImplementedError

    # Plain all-reduce (`arfusion::all_reduce`): an all-reduce the pass does not fuse into a site.
    # `plain_why_not` decides from same-on-every-rank facts (tokens None: decided at run time),
    # `prepare_plain` readies the kernel's resources at run time (collective where it makes
    # anything; never during capture), `all_reduce` returns the sum as a new tensor. A backend
    # without a fast kernel says why not, and the op runs NCCL on the caller's stream.

    def plain_why_not(self, call: Call, max_bytes_override: int | None = None) -> Reason | None:
        """None if this backend's fast all-reduce takes `call` (its `form` is core.PLAIN)."""
        return Reason(Why.NO_KERNEL, f"backend {self.name} has no fast plain all-reduce")

    def prepare_plain(self, call: Call) -> Reason | None:
        """Run time only, after `plain_why_not` accepted: None when ready, else why not."""
        return None

    def all_reduce(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of `x` ([T, H], contiguous), as a new tensor."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what this backend holds (workspaces, IPC buffers). Collective where it made
        anything: call it on every rank, after the last call. Also registered at exit."""


def over_cap(call: Call, cap: int | None, source: str) -> Reason | None:
    """The size rule every kernel shares: fused up to `cap` bytes per rank, inclusive (None: no
    cap; tokens unknown: decided at run time)."""
    if cap is not None and call.nbytes is not None and call.nbytes > cap:
        return Reason(Why.SIZE_CAP, f"{call.nbytes} bytes per rank > cap {cap} ({source})")
    return None
