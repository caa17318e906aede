"""Backend registry and selection.

`backend="auto"` picks FlashInfer on NVIDIA GPUs, aiter on ROCm GPUs and the PyTorch
reference elsewhere. On a GPU, if the preferred kernel library is missing, nothing is fused:
the reference backend there would be slower than Inductor's own fused norm kernel.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from ..decisions import Reason, Why
from .base import Backend, Capabilities

log = logging.getLogger("arfusion")

_IMPLEMENTATIONS = {
    "torch": ("arfusion.backends.torch_ref", "TorchBackend"),
    "flashinfer": ("arfusion.backends.flashinfer", "FlashInferBackend"),
    "aiter": ("arfusion.backends.aiter", "AiterBackend"),
}


@functools.cache
def get_backend(name: str) -> Backend | Reason:
    """The backend instance, or why it cannot be loaded."""
    module_name, class_name = _IMPLEMENTATIONS[name]
    try:
        return getattr(importlib.import_module(module_name), class_name)()
    except Exception as e:  # a backend module that fails to import just isn't there
        return Reason(Why.NO_BACKEND, f"{name} backend not loadable: {type(e).__name__}: {e}")


def preferred_backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "aiter" if torch.version.hip else "flashinfer"
    return "torch"


def resolve(requested: str, device: torch.device) -> tuple[Backend | None, Reason | None]:
    """(backend, None) if `requested` can run on `device`, else (None, why not)."""
    name = preferred_backend(device) if requested == "auto" else requested
    backend = get_backend(name)
    if isinstance(backend, Reason):
        return None, backend
    reason = backend.unavailable(device)
    if reason:
        return None, reason.but(name)
    return backend, None


def fingerprint() -> str:
    """Decision-relevant state outside the source (library versions, tuned tables)."""
    parts = []
    for name in _IMPLEMENTATIONS:
        backend = get_backend(name)
        parts.append(f"{name}={backend if isinstance(backend, Reason) else backend.fingerprint()}")
    return ";".join(parts)
