"""`python -m pytest tests/gpu`: every GPU check, each launched as a GPU session launches it
(gpu_launch.py), each skipped with the reason where this machine lacks what it needs.

Every test here is marked `gpu`, `multiproc` (it starts torchrun or python) and `slow` (minutes
on a GPU), so `-m "not slow"` leaves them out. Results go under $ARFUSION_GPU_OUT (default: a
directory in pytest's tmp, printed at the end): one directory per launch with its JSON and
log.txt, and summary.json, one row per test (outcome, seconds, skip reason).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gpu_launch import OUT_ENV, Launcher, cuda_gpus

HERE = Path(__file__).resolve().parent
_results: dict = {"root": None, "tests": {}, "ids": set()}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).resolve().parent == HERE:
            _results["ids"].add(item.nodeid)
            for mark in (pytest.mark.gpu, pytest.mark.multiproc, pytest.mark.slow):
                item.add_marker(mark)


@pytest.fixture(scope="session")
def gpu_out(tmp_path_factory) -> Path:
    """The results root: $ARFUSION_GPU_OUT, else a fresh directory in pytest's tmp."""
    root = Path(os.environ[OUT_ENV]) if os.environ.get(OUT_ENV) else tmp_path_factory.mktemp("gpu_out")
    root.mkdir(parents=True, exist_ok=True)
    _results["root"] = root
    return root


@pytest.fixture
def launch(gpu_out, request) -> Launcher:
    return Launcher(gpu_out, request.node.name)


def pytest_runtest_logreport(report):
    if report.nodeid not in _results["ids"]:
        return
    row = _results["tests"].setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    row["seconds"] = round(row["seconds"] + report.duration, 1)
    if report.skipped:
        row["outcome"] = "skipped"
        row["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        row["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"


def pytest_sessionfinish(session, exitstatus):
    tests = _results["tests"]
    if not tests:
        return
    root = _results["root"] or (Path(os.environ[OUT_ENV]) if os.environ.get(OUT_ENV) else None)
    if root is None:  # everything skipped before any launch: nothing to keep
        return
    root.mkdir(parents=True, exist_ok=True)
    summary = {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), "cuda_gpus": cuda_gpus(), "tests": tests}
    (root / "summary.json").write_text(json.dumps(summary, indent=1))


def pytest_terminal_summary(terminalreporter):
    if _results["root"] is not None and _results["tests"]:
        terminalreporter.write_line(f"GPU check results: {_results['root']}")
