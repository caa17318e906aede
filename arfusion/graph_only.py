"""A torch.compile backend that stops where arfusion's work ends: Inductor up to and including its
post-grad passes (arfusion's pass is one of them), then the rewritten graph runs as it is, op by
op, without Inductor generating or building kernels.

What the pass decides is decided there, so the decisions are those of a full compile. Under
torch's fake process group (`arfusion check`, `arfusion.testing.fusion_report`) nothing the graph
computes is meaningful anyway, and the C++ or Triton kernels Inductor builds after the pass are
most of a compile's time (about 60% of `arfusion check`'s on a 2-core CPU with an empty cache).

It uses Inductor internals (`compile_fx`'s `inner_compile` hook and the steps Inductor takes
before its post-grad passes). `backend` returns None where this torch lacks one of them: callers
then compile fully.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

try:  # Inductor's own functions for the steps up to and including its post-grad passes
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import compile_fx as _inductor
    from torch._inductor.virtualized import V
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:
    _inductor = None

_STEPS = ("compile_fx", "view_to_reshape", "fake_tensor_prop", "_recursive_post_grad_passes")


def _steps():
    """Inductor's functions for the steps before and including its post-grad passes, or None
    where this torch has not got them all."""
    if _inductor is None or not all(hasattr(_inductor, name) for name in _STEPS):
        return None
    return tuple(getattr(_inductor, name) for name in _STEPS)


def backend(options: dict) -> Callable | None:
    """A torch.compile backend: Inductor with `options` (its config, as `torch.compile(options=)`
    takes them) through the post-grad passes; the graph then runs unlowered. None where this
    torch lacks the internals it needs."""
    steps = _steps()
    if steps is None:
        return None
    compile_fx, view_to_reshape, fake_tensor_prop, post_grad_passes = steps

    def inner_compile(gm: torch.fx.GraphModule, example_inputs, *, is_inference: bool = False, **_):
        # As Inductor's compile_fx_inner does before lowering: outside the tracing's fake mode,
        # views as reshapes, fresh fake values on every node, then the post-grad passes.
        with _disable_current_modes():
            view_to_reshape(gm)
            with torch.no_grad():
                fake_mode = fake_tensor_prop(gm, example_inputs)
            with V.set_fake_mode(fake_mode):
                post_grad_passes(gm, is_inference=is_inference)
            gm.recompile()
        return make_boxed_func(gm.forward)

    return functools.partial(compile_fx, inner_compile=inner_compile, config_patches=dict(options))
