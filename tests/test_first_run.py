"""What a newcomer's first run prints: known third-party noise filtered (and nothing else), and
transformers' continuous batching asked for nothing it would ignore with a warning.

The examples and `arfusion check`, run as a user runs them, are checked whole in
tests/test_example.py, tests/test_serve_example.py and tests/test_check.py.
"""

from __future__ import annotations

import enum
import logging
import os

import pytest
import torch

from arfusion import noise
from arfusion.testing import LogLines, fake_world

transformers = pytest.importorskip("transformers")


@pytest.fixture
def heard(monkeypatch):
    """A handler on each logger of `noise.KNOWN`, with no filter on it (another test of this process
    may have installed them: `arfusion check` does); the loggers' filters as they were afterwards."""
    kept = LogLines(logging.DEBUG)
    for name, _, _ in noise.KNOWN:
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "filters", [])
        logger.addHandler(kept)
    yield kept
    for name, _, _ in noise.KNOWN:
        logging.getLogger(name).removeHandler(kept)


def test_known_noise_is_dropped_and_nothing_else(heard):
    ours = enum.Enum("Ours", "A")  # an Enum of someone else than torchao: its warning stays
    theirs = enum.Enum("KernelPreference", "AUTO", module="torchao.quantization.quantize_.common.kernel_preference")
    enum_warning = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
                    "type. Calling register_constant() on Enum subclasses is deprecated and will be an error in "
                    "a future release.")

    def say_everything():
        logging.getLogger("torchao").warning("Failed to load /x/_C.so: libcudart.so.13: cannot open shared object")
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch version.")
        logging.getLogger("torch.utils._pytree").warning(enum_warning, theirs)
        logging.getLogger("torch.utils._pytree").warning(enum_warning, ours)
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/c")
        logging.getLogger("torch.utils.cpp_extension").warning("Error checking compiler version for c++")
        dtensor = logging.getLogger("torch.distributed.tensor._collective_utils")  # as its warning_once says it
        dtensor.warning("CPU process group does not support alltoall yet, falling back with allgather + chunk!")
        dtensor.warning("CPU process group does not support reduce_scatter yet")  # not the one known: it stays

    say_everything()
    assert len(heard.lines) == 8  # without the filters every line is heard
    heard.lines.clear()
    noise.quiet_known_noise()
    noise.quiet_known_noise()  # a second call adds nothing
    say_everything()
    assert heard.lines == ["Skipping import of cpp extensions due to incompatible torch version.",
                           enum_warning % ours, "Error checking compiler version for c++",
                           "CPU process group does not support reduce_scatter yet"]


def test_continuous_batching_on_a_cpu_is_asked_only_what_it_runs(monkeypatch):
    """On a CPU (no decode fast path: that needs Flash Attention on CUDA) no decode compile config,
    and over a group that is not NCCL's, NCCL's graph mixing left alone: transformers warns of
    both ("... Ignoring it.", "Setting NCCL_GRAPH_MIXING_SUPPORT = 0 ...") when asked."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    from arfusion.hf.configs import tiny_config
    from arfusion.hf.continuous_batching import cb_config, decode_fast_path

    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    warned = LogLines(logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("ContinuousBatchingLogger", "transformers.generation.configuration_utils")]
    for logger in loggers:
        logger.addHandler(warned)
    try:
        with fake_world(2):  # WORLD_SIZE=2, as under torchrun
            model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
            compiled = CompileConfig(mode=None, fullgraph=False)
            assert not decode_fast_path(model)
            config = cb_config(model, compiled, num_blocks=16, max_batch_tokens=32)
            try:
                from transformers.generation.continuous_batching.initialization import \
                    resolve_continuous_batching_config
                resolve_continuous_batching_config(model.config.get_text_config(), config, None, False,
                                                   device=torch.device("cpu"))
            except ImportError:
                pass  # another transformers: the fields below still say it
    finally:
        for logger in loggers:
            logger.removeHandler(warned)
    assert config.varlen_compile_config is compiled and config.decode_compile_config is None
    assert config.num_blocks == 16 and config.max_batch_tokens == 32
    assert getattr(config, "disable_nccl_graph_mixing", False) is False
    assert "NCCL_GRAPH_MIXING_SUPPORT" not in os.environ
    assert not [line for line in warned.lines if "decode_compile_config" in line or "NCCL_GRAPH_MIXING" in line], \
        warned.lines
