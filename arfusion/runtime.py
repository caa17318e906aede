"""Run-time helpers shared by the ops and the backends: process groups, CUDA-graph capture,
compiled fallbacks and log-once messages."""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import types
import weakref
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from . import stats

T = TypeVar("T")
log = logging.getLogger("arfusion")
_logged: set[str] = set()


def log_once(message: str) -> None:
    """An INFO line, once per process (run-time decisions repeat on every call)."""
    if message not in _logged:
        _logged.add(message)
        log.info(message)


# ----------------------------------------------------------------- CUDA graphs


@functools.cache
def _has_cuda() -> bool:
    return torch.cuda.is_available()


def capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph."""
    return _has_cuda() and torch.cuda.is_current_stream_capturing()


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


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


def _mark_token_dims(args) -> None:
    # Token counts vary, hidden sizes do not: only the leading dims are symbolic. A fully dynamic
    # compile (dynamic=True, hidden symbolic too) made the per-group quant kernel 2-5x slower on
    # H200 (10.5 vs 54.5 us at 2048 x 4096; docs/history/2026-11-26-benchmarks-before-the-matrix.md).
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            for d in range(a.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(a, d)


@functools.cache
def compiled(fn):
    """`fn` under torch.compile, token dims dynamic, compiled on first use and never during
    CUDA-graph capture: there Inductor would compile and benchmark kernels outside the graph, so
    a capture runs code compiled earlier when its guards pass and `fn` eagerly otherwise. An
    eager run inside a capture stays in the graph, replayed at every step: it is counted
    (`stats()["eager_in_cuda_graphs"]`) and logged once at INFO with the guards that failed."""
    # A private copy of the code object: dynamo's recompile limit (8) counts entries per code
    # object, and each site (and T == 1, dtype) is an entry of its own.
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    fast = torch.compile(own)
    broken: list[str] = []

    def run(*args, **kwargs):
        if broken:
            return fn(*args, **kwargs)
        try:
            _mark_token_dims(args)
            with torch.no_grad(), _below_autograd():
                if capturing():
                    return _in_capture(fn, fast, args, kwargs)
                return fast(*args, **kwargs)
        except Exception as e:  # e.g. no working Triton: stay correct, just slower
            broken.append(f"{type(e).__name__}: {e}")
            log_once(f"arfusion: compiling {fn.__name__} failed, running it eagerly: {broken[0][:300]}")
            return fn(*args, **kwargs)

    return run


def _below_autograd():
    """Dispatch below autograd, as a kernel does. Dynamo's tensor guards compare dispatch keys after
    this thread's exclusions, so here an inference tensor and a normal one (an activation made under
    transformers' inference mode, a weight made before it) pass the same guards, and under grad mode
    or not. Without it a serving loop recompiled the unfused path's norm, and its CUDA-graph captures,
    which cannot compile, ran it eagerly at every replay (about 20% of an 8192-token prefill step at
    TP=2 on 4xH200, docs/benchmarks.md, machine X)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOGRAD_KEYS)


_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))


_RECOMPILE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def _in_capture(fn, fast, args, kwargs):
    """fast(...) where code compiled earlier passes its guards; else fn eagerly, counted and logged
    (the guards' failures are what Dynamo's fail_on_recompile stance reports)."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return fast(*args, **kwargs)
    except RuntimeError as e:
        if _RECOMPILE not in str(e):
            raise
        why = " ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip().startswith("- "))
    stats.record_eager_in_capture(fn.__name__)
    log_once(f"arfusion: {fn.__name__} ran eagerly inside a CUDA-graph capture (no compiled version passed its "
             f"guards; every replay runs it eagerly): {why[:600] or 'no compiled version yet'}")
    return fn(*args, **kwargs)


_scalars: dict[int, tuple[Any, int, float]] = {}  # id -> (weak ref, version, value)


def scalar_value(t: torch.Tensor) -> float | None:
    """The value of a 0-d tensor (an eps held as a buffer) as a float, read once per tensor and
    version: a GPU buffer synchronises the first time it is read and again only after it is written
    in place (which bumps its version). None during CUDA-graph capture for one never read before:
    a read would synchronise inside the capture, so the caller computes with the tensor itself."""
    if t.device.type == "cpu":
        return float(t)
    entry = _scalars.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    if capturing():
        return None
    value = float(t)
    _scalars[id(t)] = (weakref.ref(t, lambda _, key=id(t): _scalars.pop(key, None)), t._version, value)
    return value


# ----------------------------------------------------------------- process groups


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


def same_ranks(group_a: str, group_b: str) -> bool:
    """True where two group names are one group, or two live groups of the same ranks in the same
    order: an all-reduce over either sums the same values (transformers >= 5.25 all-reduces a MoE
    layer's routed experts over its expert-parallel group and the shared expert over its TP group,
    two groups of the same ranks)."""
    if group_a == group_b:
        return True
    ranks = live_ranks(resolve_group(group_a))
    return ranks is not None and ranks == live_ranks(resolve_group(group_b))


def group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()


def comm_device(group, device: torch.device) -> torch.device:
    """Where `group` communicates: the GPU for NCCL, the CPU otherwise (gloo)."""
    return device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")


def live_ranks(group) -> list[int] | None:
    """The global ranks of `group` in its order; None for no group, or one that
    destroy_process_group has removed (its object may still be held)."""
    if group is None:
        return None
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return None


def group_is_live(group) -> bool:
    return live_ranks(group) is not None


class PerGroup(dict):
    """Backend state per process group, looked up by the group's name.

    Names are handed out again: destroy_process_group + init_process_group make a new "0" with
    other peers, and a graph compiled before resolves the name when it runs. State made for the
    old group (buffers opened from the old peers' IPC handles) would then reduce with the old
    peers, silently. So each entry remembers the ProcessGroup it was made for, and a name that
    now resolves to another one gets fresh state; the replaced entry moves to `stale` (graphs
    captured earlier may still point into its buffers) and is freed with the rest at close().

    With `same_ranks_share`, a group whose ranks (in order) are those of another live group gets
    that group's state, not a new one: transformers >= 5.25 all-reduces a MoE layer's experts over
    its expert-parallel group and the rest over the TP group, two groups of the same GPUs, and one
    set of buffers serves both (each rank issues its calls on either group in the same order).
    """

    def __init__(self, make: Callable[[], Any], resolve: Callable[[str], Any] = resolve_group,
                 same_ranks_share: bool = False):
        super().__init__()
        self.make, self.resolve, self.same_ranks_share = make, resolve, same_ranks_share
        self.stale: list = []
        self._made_for: dict[str, Any] = {}

    def current(self, group_name: str):
        """The state of the group the name resolves to now; made on first use."""
        group = self.resolve(group_name)
        if group_name in self and self._made_for[group_name] != group:  # ProcessGroup: by identity
            self.stale.append(self.pop(group_name))
        if group_name not in self:
            self[group_name] = self._twin(group) or self.make()
            self._made_for[group_name] = group
        return self[group_name]

    def _twin(self, group):
        """The state of another live group of the same ranks in the same order, where shared."""
        ranks = live_ranks(group) if self.same_ranks_share else None
        if ranks is None:
            return None
        return next((self[name] for name, other in self._made_for.items() if live_ranks(other) == ranks), None)

    def everything(self) -> list:
        """Current and stale states, each once (groups of the same ranks may share one): what
        close() frees."""
        return list({id(state): state for state in [*self.values(), *self.stale]}.values())

    def clear(self) -> None:
        super().clear()
        self.stale.clear()
        self._made_for.clear()
