"""How `pytest tests/gpu` launches the GPU check scripts: what a check needs (skipped with the
reason otherwise) and one runner that starts a script the way a GPU session does (torchrun or
python, from the repository root) and keeps its output.

Each launch gets its own directory under the results root (`ARFUSION_GPU_OUT`, default a
directory in pytest's tmp): the script's JSON (`--out` or `$OUT`) and `log.txt`, its output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT_ENV = "ARFUSION_GPU_OUT"
# Never NVLink multicast on the GPU machines (benchmarks/common.py, .device/setup.sh).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def cuda_gpus() -> int:
    """NVIDIA GPUs visible to torch (0 on a CPU build or ROCm). Does not create a CUDA context."""
    if torch.version.hip or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def has_module(dotted: str) -> bool:
    """Whether `dotted` can be imported, without importing it (FlashInfer's import is slow)."""
    top, _, rest = dotted.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    for location in spec.submodule_search_locations or ():
        base = Path(location, *rest.split("."))
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return True
    return False


def missing(gpus: int = 1, flashinfer: bool = True, modules: tuple[str, ...] = ()) -> str | None:
    """Why a check cannot run here, or None."""
    found = cuda_gpus()
    if found == 0:
        return "no CUDA GPU" + (" (ROCm build)" if torch.version.hip else "")
    if found < gpus:
        return f"needs {gpus} CUDA GPUs, found {found}"
    if flashinfer and not has_module("flashinfer"):
        return "FlashInfer is not installed"
    for name in modules:
        if not has_module(name):
            return f"needs {name}"
    return None


def needs(gpus: int = 1, flashinfer: bool = True, modules: tuple[str, ...] = ()):
    """A skip mark with the reason where the check cannot run."""
    reason = missing(gpus, flashinfer, modules)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    returncode: int
    output: str
    out: Path  # the launch's directory: its JSON and log.txt
    seconds: float
    timed_out: bool

    def tail(self, chars: int = 5000) -> str:
        return ("TIMED OUT\n" if self.timed_out else "") + self.output[-chars:]

    def json(self, name: str):
        path = self.out / name
        assert path.exists(), f"{path} was not written\n{self.tail()}"
        return json.loads(path.read_text())


class Launcher:
    """launch(script, *args, nproc=N, env={...}, timeout=s) -> Run.

    nproc=None: `python script ...`; else `python -m torch.distributed.run --nproc-per-node N
    --master-port <free> script ...` (every rank on GPU LOCAL_RANK, or all on GPU 0 with the
    script's --shared-gpu). `{out}` in an argument is replaced by the launch's directory, which is
    also $OUT. Output is echoed as it comes (with -s a hang shows where it is) and kept in log.txt;
    past the timeout the whole process group is stopped (TERM, then KILL)."""

    def __init__(self, root: Path, name: str):
        self.root, self.name, self.count = root, re.sub(r"[^\w.-]+", "_", name).strip("_"), 0

    def __call__(self, script: str, *args: str, nproc: int | None = None, env: dict | None = None,
                 timeout: float = 600) -> Run:
        self.count += 1
        out = self.root / (self.name if self.count == 1 else f"{self.name}.{self.count}")
        out.mkdir(parents=True, exist_ok=True)
        args = [a.replace("{out}", str(out)) for a in args]
        launcher = [sys.executable] if nproc is None else \
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-port", str(free_port())]
        cmd = [*launcher, script, *args]
        full_env = {**NO_MULTICAST, **os.environ, "OUT": str(out), "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                    **(env or {})}
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        timed_out = threading.Event()

        def stop():
            timed_out.set()
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    return
                try:
                    proc.wait(wait)
                    return
                except subprocess.TimeoutExpired:
                    pass

        watchdog = threading.Timer(timeout, stop)
        watchdog.start()
        lines = [f"$ {' '.join(cmd)}\n"]
        with open(out / "log.txt", "w") as log:
            log.write(lines[0])
            try:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                    lines.append(line)
                proc.wait()
            finally:
                watchdog.cancel()
                if proc.poll() is None:
                    stop()
        seconds = time.monotonic() - started
        return Run(proc.returncode, "".join(lines), out, seconds, timed_out.is_set())
