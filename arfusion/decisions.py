"""What the pass decides for each all-reduce, as values.

Each all-reduce gets a `Decision`: its `Fate`, and for every fate but FUSED the `Reason` it was
not fused, a stable `Why` code plus a message for people. Stats, reports, `arfusion check`,
the coverage sweeps and the tests compare codes; messages may be reworded freely. "No reason" is
None everywhere, and so is "no cap" (a size limit that does not apply).

Nothing here imports the rest of arfusion: backends and patterns build their reasons with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Fate(str, Enum):
    """What happens to one all-reduce of a compiled graph."""

    FUSED = "fused"  # with its residual add and norm (and quant) into arfusion's fused op
    MERGED = "merged"  # folded into another all-reduce by a rewrite (AR(a) + AR(b) -> AR(a + b))
    FAST_PATH = "fast_path"  # not fused: the backend's fast all-reduce (arfusion::all_reduce)
    CALLERS_STREAM = "callers_stream"  # not fused: NCCL, blocking, on the caller's stream (GPUs)
    NCCL = "nccl"  # not fused: left to Inductor's own all-reduce


class Why(str, Enum):
    """Why an all-reduce was not fused, or why a kernel declined a call: stable codes."""

    # The all-reduce and what reads it (patterns).
    NOT_SUM = "not_sum"  # a max/min/avg all-reduce
    NOT_AWAITED = "not_awaited"  # its result is read other than through one wait
    ZERO_TOKENS = "zero_tokens"  # an empty batch: traced with one, or (run time) called with one
    NO_TOKEN_DIM = "no_token_dim"  # a tensor without a token dim
    NO_NORM = "no_norm"  # no RMSNorm over the hidden dim reads the value
    GRAPH_BREAK = "graph_break"  # a graph break put the norm in another graph (graph_breaks)
    GRAPH_OUTPUT = "graph_output"  # the value leaves the graph, no break recorded (the model's output)
    LAYERNORM = "layernorm"  # the norm subtracts the mean
    L2_NORM = "l2_norm"  # x / ||x||: RMSNorm times 1/sqrt(hidden)
    HYPER_CONNECTIONS = "hyper_connections"  # spread over k residual streams before any norm
    SCALED = "scaled"  # scaled before the norm in a way the op cannot take
    NOT_RMS = "not_rms"  # computes nothing like all_reduce [+ residual] -> RMSNorm
    ROUNDING = "rounding"  # an RMSNorm that rounds unlike the fused kernels
    BOUNDED = "bounded"  # a clamp / min / max / where on the hidden states before the norm
    RANDOM = "random"  # random draws (dropout in training mode) act on the hidden states before the norm
    QUANT_BOUNDED = "quant_bounded"  # (a note: the site fuses, its quant stays outside) the quant acts unlike its form
    # beyond the probe's ordinary rows: a floor or ceiling on its scale, a clamp on a static scale
    OTHER_INPUTS = "other_inputs"  # the norm reads tensors of another role
    RESIDUAL_TERMS = "residual_terms"  # too many activation-sized terms
    NORM_INPUTS = "norm_inputs"  # more than one weight or scalar
    RESIDUAL_DTYPE = "residual_dtype"  # a residual term of another dtype
    WEIGHT_DTYPE = "weight_dtype"  # a norm weight of another dtype than the activations
    EPS_SCALAR = "eps_scalar"  # a scalar input other than eps changes the norm
    PROBE_FAILED = "probe_failed"  # the region could not be evaluated
    READ_ELSEWHERE = "read_elsewhere"  # an intermediate of the site is read outside it
    SEQUENCE_PARALLEL = "sequence_parallel"  # a reduce-scatter: only all_reduce sites fuse
    MERGED = "merged"  # folded into another all-reduce (MERGED's reason: into what)
    # The rewrite.
    PER_RANK = "per_rank"  # a move across an all-reduce declined: an operand may differ per rank (a weight shard)
    SYMBOLIC_SHAPE = "symbolic_shape"  # a symbolic size between all-reduce and norm cannot be named
    OUTPUT_DTYPE = "output_dtype"  # an op output would replace a value of another dtype
    PASS_FAILED = "pass_failed"  # arfusion raised on the graph and put it back (a bug of ours)
    # Backends: what a kernel takes (compile time and run time, the same rules: policy).
    NO_BACKEND = "no_backend"  # the backend or its library cannot run here
    DEVICE = "device"
    DTYPE = "dtype"
    NORM_FORM = "norm_form"
    QUANT_FORM = "quant_form"
    WORLD_SIZE = "world_size"
    NEEDS_RESIDUAL = "needs_residual"
    SHAPE = "shape"  # a hidden size or layout the kernel does not take
    GPU_ARCH = "gpu_arch"  # the kernel needs another GPU architecture or CUDA version
    NO_TABLE = "no_table"  # no dispatch entry for this GPU, world size and dtype
    SIZE_CAP = "size_cap"  # the per-rank input is above the cap
    NO_KERNEL = "no_kernel"  # the backend has no such kernel (MoE combine, a quantized level, ...)
    FAST_PATH_OFF = "fast_path_off"  # PassConfig(fast_all_reduce=False)
    NOT_FLOATING = "not_floating"  # a value the fast all-reduce does not take
    BELOW_CROSSOVER = "below_crossover"  # the quantized all-reduce pays only from a larger size
    NO_CROSSOVER = "no_crossover"  # no measured crossover for the quantized all-reduce
    CODEC_TAKES = "codec_takes"  # the quantized all-reduce takes the call instead
    NEEDS_COLLECTIVE = "needs_collective"  # the kernel needs another collective between its calls
    RUNTIME = "runtime"  # at run time: a workspace, a buffer or a peer was not ready


@dataclass(frozen=True)
class Reason:
    """Why not: a stable code and a message for people."""

    code: Why
    message: str

    def __str__(self) -> str:
        return self.message

    def but(self, prefix: str) -> "Reason":
        """The same code, the message prefixed (`prefix: message`)."""
        return Reason(self.code, f"{prefix}: {self.message}")


@dataclass(frozen=True)
class Decision:
    """What the pass did with one all-reduce of one compiled graph. `form` names the fused form
    (FUSED); `backend` the fast all-reduce's (FAST_PATH); `not_fused` says why it was not fused
    (every fate but FUSED; MERGED: into what); `not_fast` why it is not on the fast path either
    (NCCL, CALLERS_STREAM)."""

    all_reduce: str
    fate: Fate
    form: str = ""
    backend: str = ""
    not_fused: Reason | None = None
    not_fast: Reason | None = None
    graph_break: str = ""  # the function whose graph break put the norm in another graph (Why.GRAPH_BREAK)
    quant_outside: Reason | None = None  # FUSED: why a quant after the norm stayed outside the op (QUANT_BOUNDED)

    @property
    def detail(self) -> str:
        """One line for people: the form, or why not (and why not on the fast path)."""
        if self.fate is Fate.FUSED:
            return self.form if self.quant_outside is None else f"{self.form}; {self.quant_outside}"
        parts = [f"{self.backend}; not fused: {self.not_fused}" if self.fate is Fate.FAST_PATH
                 else str(self.not_fused or "")]
        if self.not_fast is not None:
            parts.append(f"not on the fast path: {self.not_fast}")
        return "; ".join(p for p in parts if p)

    def as_dict(self) -> dict:
        """JSON-ready: codes and messages apart."""
        return {"all_reduce": self.all_reduce, "fate": self.fate.value, "form": self.form, "backend": self.backend,
                "code": self.not_fused.code.value if self.not_fused else None,
                "reason": self.not_fused.message if self.not_fused else None,
                "fast_path_code": self.not_fast.code.value if self.not_fast else None,
                "fast_path_reason": self.not_fast.message if self.not_fast else None,
                "graph_break": self.graph_break, "detail": self.detail,
                "quant_outside_code": self.quant_outside.code.value if self.quant_outside else None}
