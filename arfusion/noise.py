"""Known third-party log lines that a user of arfusion can do nothing about, filtered by logger
and by the start of the message: everything else those loggers say still shows.

The examples and `arfusion check` call `quiet_known_noise()` at import, before transformers
(which imports torchao whenever it is installed) is loaded. A library user who wants the same
calls it too; arfusion never installs the filters on its own.
"""

from __future__ import annotations

import logging

# (logger, the start of the message as its source writes it, the module its first argument must
# come from or None). Each line says where the message comes from.
KNOWN = (
    # torchao/__init__.py loads torchao's compiled extensions at import; on a CPU build of torch
    # each one fails with this warning. arfusion uses nothing of torchao's extensions.
    ("torchao", "Failed to load ", None),
    # torchao/utils.py (register_as_pytree_constant, torchao 0.18) registers its enums
    # KernelPreference and ScaleCalculationMode as pytree constants; torch/utils/_pytree.py
    # (torch 2.13 and newer) warns that an Enum needs no registration. torchao's to change.
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported", "torchao"),
    # torch/utils/cpp_extension.py, at its import: a CUDA build of torch on a machine with a CUDA
    # toolkit but no GPU (pip's default torch on Linux is a CUDA build).
    ("torch.utils.cpp_extension", "No CUDA runtime is found", None),
    # torch/distributed/tensor/_collective_utils.py (shard_dim_alltoall), on a CPU mesh only: DTensor
    # moves a shard from one dim to another by all-gather + chunk where gloo has no all-to-all.
    # torch 2.15 takes that route for `weight[padding_idx]` of a vocab-sharded embedding
    # (transformers' _init_weights zeroes the padding row: Gemma 3, Command-R); 2.13 did not.
    ("torch.distributed.tensor._collective_utils", "CPU process group does not support alltoall yet", None),
)


class _DropKnown(logging.Filter):
    def __init__(self, start: str, module: str | None):
        super().__init__()
        self.start, self.module = start, module

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(self.start):
            return True
        first = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return self.module is not None and not getattr(first, "__module__", "").startswith(self.module)


def quiet_known_noise() -> None:
    """Drops the messages of `KNOWN` from their loggers (once per process: calling again adds nothing)."""
    for name, start, module in KNOWN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.start == start for f in logger.filters):
            logger.addFilter(_DropKnown(start, module))
