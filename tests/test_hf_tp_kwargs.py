"""arfusion.hf.tp_kwargs: the `tp_plan` spelling the installed transformers accepts."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import warnings

import pytest

transformers = pytest.importorskip("transformers")

from arfusion import hf  # noqa: E402


def _live_transformers():
    """The module `from transformers import ...` reads now: importing a modeling module can swap
    the lazy `sys.modules["transformers"]` for a new object, so the one imported above may be stale."""
    return importlib.import_module("transformers")


@pytest.mark.multiproc
def test_import_arfusion_does_not_import_transformers():
    code = "import sys, arfusion, arfusion.hf; print('transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def _new_api_available() -> bool:
    fields = {f.name for f in dataclasses.fields(transformers.DistributedConfig)} \
        if dataclasses.is_dataclass(transformers.DistributedConfig) else set()
    return "tp_plan" in fields


@pytest.mark.skipif(not _new_api_available(), reason="installed transformers has no DistributedConfig(tp_plan=)")
def test_new_spelling_where_transformers_takes_it():
    kwargs = hf.tp_kwargs("auto")
    assert set(kwargs) == {"distributed_config"}
    assert isinstance(kwargs["distributed_config"], transformers.DistributedConfig)
    assert kwargs["distributed_config"].tp_plan == "auto"
    plan = {"layers.*.self_attn.q_proj": "colwise"}
    assert hf.tp_kwargs(plan)["distributed_config"].tp_plan == plan


def test_old_spelling_when_distributed_config_lacks_tp_plan(monkeypatch):
    @dataclasses.dataclass
    class OldDistributedConfig:  # as in releases whose DistributedConfig only knows other fields
        enable_expert_parallel: bool = False

    monkeypatch.setattr(_live_transformers(), "DistributedConfig", OldDistributedConfig)
    assert hf.tp_kwargs("auto") == {"tp_plan": "auto"}


def test_old_spelling_when_from_pretrained_ignores_distributed_config(monkeypatch):
    class OldModel:
        @classmethod
        def from_pretrained(cls, path, *args, tp_plan=None, **kwargs):
            return kwargs.pop("device_map", None)

    monkeypatch.setattr(_live_transformers(), "PreTrainedModel", OldModel)
    assert hf.tp_kwargs("auto") == {"tp_plan": "auto"}


def test_old_spelling_without_distributed_config(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_distributed_config(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "transformers" and fromlist and "DistributedConfig" in fromlist:
            raise ImportError("cannot import name 'DistributedConfig' from 'transformers'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_distributed_config)
    assert hf.tp_kwargs("auto") == {"tp_plan": "auto"}


@pytest.mark.parametrize("spelling", ["tp_kwargs", "bare"])
def test_from_pretrained_with_it_does_not_warn(tmp_path, monkeypatch, spelling):
    """A one-process TP load with the returned kwargs: no FutureWarning about `tp_plan` (the bare
    argument, where transformers deprecates it, shows that the check sees the warning)."""
    if spelling == "bare" and "distributed_config" not in hf.tp_kwargs("auto"):
        pytest.skip("installed transformers takes the bare tp_plan without a warning")
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    store = dist.FileStore(str(tmp_path / "store"), 1)  # no port to collide with
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            kwargs = hf.tp_kwargs("auto") if spelling == "tp_kwargs" else {"tp_plan": "auto"}
            model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16, **kwargs)
        assert model is not None
        warned = [str(w.message) for w in seen if "tp_plan" in str(w.message)]
        assert bool(warned) == (spelling == "bare"), warned
    finally:
        dist.destroy_process_group()
