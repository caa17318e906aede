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


# ------------------------------------------------------------- experts: TP plan or expert parallelism
class _Config:
    """A config as transformers' classes spell the plans (class attributes), with a text config."""

    def __init__(self, tp_plan, ep_plan=None, num_experts=8):
        self.base_model_tp_plan, self.base_model_ep_plan = tp_plan, ep_plan or {}
        self.num_experts = num_experts if ep_plan else None

    def get_text_config(self):
        return self


ATTENTION = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
EP_PLAN = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm",
           "layers.*.mlp.experts": "ep_dispatch_experts"}
EXPERTS_BY_TP = {**ATTENTION, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                 "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}


def _has_ep_size() -> bool:
    return _new_api_available() and "ep_size" in {f.name for f in dataclasses.fields(transformers.DistributedConfig)}


def test_which_models_need_expert_parallelism():
    """Experts left whole by the TP plan (transformers >= 5.25) and sharded by an EP plan: yes.
    Experts the TP plan shards (<= 5.24), a dense model, a model with only an EP plan's name: no."""
    assert hf.experts_need_expert_parallel(_Config(ATTENTION, EP_PLAN))
    assert not hf.experts_need_expert_parallel(_Config(EXPERTS_BY_TP, EP_PLAN))
    assert not hf.experts_need_expert_parallel(_Config(ATTENTION))
    from transformers import AutoConfig

    qwen3_moe = AutoConfig.for_model("qwen3_moe")
    sharded_by_tp = any(".experts" in key for key in type(qwen3_moe).base_model_tp_plan)
    assert hf.experts_need_expert_parallel(qwen3_moe) == (not sharded_by_tp)
    assert not hf.experts_need_expert_parallel(AutoConfig.for_model("llama"))


@pytest.mark.skipif(not _has_ep_size(), reason="installed transformers' DistributedConfig has no ep_size")
def test_experts_left_whole_are_loaded_with_expert_parallelism_over_the_tp_ranks(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("INFO", logger="arfusion"):
        moe = hf.tp_kwargs("auto", config=_Config(ATTENTION, EP_PLAN))["distributed_config"]
    assert (moe.tp_plan, moe.tp_size, moe.ep_size) == ("auto", 2, 2)
    assert "expert parallelism over the same 2 ranks (ep_size=2)" in caplog.text
    four = hf.tp_kwargs("auto", config=_Config(ATTENTION, EP_PLAN), tp_size=4)["distributed_config"]
    assert (four.tp_size, four.ep_size) == (4, 4)
    for config in (_Config(EXPERTS_BY_TP, EP_PLAN), _Config(ATTENTION), None):  # as before: the TP plan alone
        assert hf.tp_kwargs("auto", config=config)["distributed_config"].ep_size == 1
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank: nothing to shard over
    assert hf.tp_kwargs("auto", config=_Config(ATTENTION, EP_PLAN))["distributed_config"].ep_size == 1


@pytest.mark.skipif(not _has_ep_size(), reason="installed transformers' DistributedConfig has no ep_size")
def test_experts_that_do_not_split_over_the_ranks_stay_whole(monkeypatch, caplog):
    """transformers would refuse ep_size=4 for 6 experts: the load keeps every expert on every rank."""
    with caplog.at_level("INFO", logger="arfusion"):
        kwargs = hf.tp_kwargs("auto", config=_Config(ATTENTION, EP_PLAN, num_experts=6), tp_size=4)
    assert kwargs["distributed_config"].ep_size == 1
    assert "6 routed experts do not split over 4 ranks" in caplog.text


@pytest.mark.skipif(not _has_ep_size(), reason="installed transformers' DistributedConfig has no ep_size")
def test_prepare_for_compile_says_where_the_experts_were_loaded_whole(caplog):
    """A MoE model loaded with tp_plan="auto" alone where the TP plan leaves its experts whole: the
    log says how to shard them; loaded through tp_kwargs(config=), or a dense model: nothing said."""
    import torch
    from transformers import AutoConfig

    from arfusion.check import causal_lm_class
    from arfusion.hf.configs import tiny_config
    from arfusion.testing import fake_world

    def load(model_type, **kwargs):
        config = tiny_config(model_type)
        with fake_world(2):
            return causal_lm_class(config).from_pretrained(None, config=config, state_dict={}, dtype=torch.float32,
                                                           **kwargs)

    whole = hf.experts_need_expert_parallel(AutoConfig.for_model("qwen3_moe"))
    with caplog.at_level("INFO", logger="arfusion"):
        assert hf.say_if_experts_are_whole(load("qwen3_moe", **hf.tp_kwargs("auto", tp_size=2))) == whole
        assert hf.say_if_experts_are_whole(load("qwen3_moe", **hf.tp_kwargs("auto", config=tiny_config("qwen3_moe"),
                                                                            tp_size=2))) is False
        assert hf.say_if_experts_are_whole(load("llama", **hf.tp_kwargs("auto", tp_size=2))) is False
        assert hf.say_if_experts_are_whole(torch.nn.Linear(2, 2)) is False  # not a transformers model
    assert ("every rank holds every expert" in caplog.text) == whole
