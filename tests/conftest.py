"""Shared fixtures: a fake process group for graph tests, and a fresh compile state per test."""

from __future__ import annotations

import os
from pathlib import Path

# Inductor's C++ kernels, cheaper to build in the suite (set before torch reads its config;
# spawned ranks and subprocesses inherit them). Neither changes what a kernel computes:
# - no line tables (-g1): about a fifth of each kernel's g++ time;
# - the vector ISA taken from the CPU's flags, not probed by building and loading a test library
#   (a g++ build per Inductor cache directory and a child process per compiling process).
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# One thread per process, as the gloo ranks and torchrun's processes have: two pytest workers share
# two cores, and Inductor then generates (and caches) the same kernels in every process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import arfusion  # noqa: E402
from arfusion.config import STRICT_ENV  # noqa: E402

# An error inside the pass fails the compile in our tests (users get an unfused graph and a
# WARNING instead, tests/test_pass_safety.py); spawned ranks inherit it.
os.environ.setdefault(STRICT_ENV, "1")


@pytest.fixture
def world_of_one(tmp_path):
    """A real gloo world of one process (collectives compute); yields the group's name."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.fixture
def fake_pg():
    """A single-process stand-in for a world of 2: graphs compile, collectives do not compute."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_compile_state(monkeypatch):
    monkeypatch.delenv("ARFUSION_DISABLE", raising=False)
    torch._dynamo.reset()
    arfusion.reset_stats()
    with torch._inductor.config.patch(fx_graph_cache=False, post_grad_custom_post_pass=None):
        yield
    torch._dynamo.reset()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The CPU suite on two workers, each test file on one of them (its module fixtures run once),
    when pytest-xdist is installed (the test extra) and no -n was given. The GPU checks keep one
    process: they time and share the GPUs."""
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None \
            or hasattr(config, "workerinput"):  # -n given, or this is a worker
        return
    if any("gpu" in Path(arg).parts for arg in config.args) or os.environ.get("ARFUSION_TEST_WORKERS") == "1":
        return
    config.option.numprocesses = int(os.environ.get("ARFUSION_TEST_WORKERS", "2"))
    config.option.dist = "loadfile"
    config.option.loadscopereorder = False  # xdist would order files by test count: keep ours (below)


def pytest_collection_modifyitems(config, items):
    """Files with multi-process tests first (each file's tests stay together, in their order): on
    two workers the long files start early and the many short ones fill in behind them."""
    heavy = {item.path for item in items if item.get_closest_marker("multiproc")}
    items.sort(key=lambda item: item.path not in heavy)
