"""PassConfig loading, installing the pass next to a user's own pass, and cache keys."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import arfusion
from arfusion import runtime
from arfusion.fusion_pass import ArFusionPass, ChainedPass

from .models import TinyDecoder


class UserPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass-v1"


# ------------------------------------------------------------------ config


def test_vllm_style_dict_and_inner_dict_load_the_same():
    outer = arfusion.PassConfig.from_dict({"pass_config": {"enable_allreduce_fusion": True, "backend": "torch"}})
    inner = arfusion.PassConfig.from_dict({"enable_allreduce_fusion": True, "backend": "torch"})
    text = arfusion.PassConfig.from_dict('{"pass_config": {"enable_allreduce_fusion": true, "backend": "torch"}}')
    assert outer == inner == text
    assert outer.enable_allreduce_fusion and outer.backend == "torch"


def test_vllm_size_cap_key_is_understood_and_other_vllm_keys_ignored():
    cfg = arfusion.PassConfig.from_dict({"pass_config": {
        "enable_allreduce_fusion": True, "fi_allreduce_fusion_max_size_mb": {"2": 64, "4": 2},
        "fuse_norm_quant": True}})
    assert cfg.max_size_mb == {2: 64.0, 4: 2.0}
    assert cfg.max_bytes(4) == 2 * 1024 * 1024 and cfg.max_bytes(8) is None


def test_unknown_key_and_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match="unknown pass_config key 'enable_allreduce_fuson'"):
        arfusion.PassConfig.from_dict({"enable_allreduce_fuson": True})
    with pytest.raises(ValueError, match="backend must be one of"):
        arfusion.PassConfig(backend="nccl")
    with pytest.raises(ValueError, match="unknown quant_forms"):
        arfusion.PassConfig(quant_forms=("fp8_static", "int4"))


def test_a_bad_quantized_level_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("ARFUSION_QUANTIZED_ALLREDUCE", "fp16")
    with pytest.raises(ValueError, match="the environment variable ARFUSION_QUANTIZED_ALLREDUCE must be off or one "
                                         r"of \('fp8'.*got 'fp16'"):
        arfusion.PassConfig()
    with pytest.raises(ValueError, match="arfusion: quantized_allreduce must be None or one of"):
        arfusion.PassConfig(quantized_allreduce="fp4")  # the argument's name, not the variable's


def test_a_config_from_python_enables_and_a_dict_keeps_its_flag(fake_pg, caplog, monkeypatch):
    """`arfusion.enable(PassConfig(backend="torch"))` fuses, as `enable()` does; a vLLM-style dict
    without the flag leaves fusion off, as vLLM does, and a config that leaves it off says so once."""
    assert arfusion.PassConfig(backend="torch").enable_allreduce_fusion
    assert not arfusion.PassConfig.from_dict({"pass_config": {"backend": "torch"}}).enable_allreduce_fusion
    model, x = TinyDecoder(64, layers=1), torch.randn(1, 4, 64, dtype=torch.bfloat16)
    arfusion.enable(arfusion.PassConfig(backend="torch"))
    try:
        with torch.no_grad():
            torch.compile(model)(x)
        assert arfusion.stats()["fused_sites"] == 3
        monkeypatch.setattr(runtime, "_logged", set())  # once per process: count this test's own
        with caplog.at_level(logging.INFO, logger="arfusion"):
            arfusion.enable({"pass_config": {"backend": "torch"}})
            arfusion.enable({"pass_config": {"backend": "torch"}})
            torch._dynamo.reset()
            arfusion.reset_stats()
            with torch.no_grad():
                torch.compile(model)(x)
        assert arfusion.stats()["fused_sites"] == 0
        off = [r for r in caplog.records if "enable_allreduce_fusion=False" in r.getMessage()]
        assert len(off) == 1, [r.getMessage() for r in caplog.records]
    finally:
        arfusion.disable()


# ------------------------------------------------------------------ installing


def test_enable_chains_after_a_user_pass_and_disable_restores_it():
    user = UserPass()
    inductor_config.post_grad_custom_post_pass = user
    ours = arfusion.enable()
    slot = inductor_config.post_grad_custom_post_pass
    assert isinstance(slot, ChainedPass) and slot.passes == [user, ours]
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))  # re-enable: replaces ours
    assert len(inductor_config.post_grad_custom_post_pass.passes) == 2
    arfusion.disable()
    assert inductor_config.post_grad_custom_post_pass is user


def test_inductor_options_keep_the_global_user_pass():
    user = UserPass()
    inductor_config.post_grad_custom_post_pass = user
    slot = arfusion.inductor_options({"enable_allreduce_fusion": True})["post_grad_custom_post_pass"]
    assert slot.passes[0] is user and isinstance(slot.passes[1], ArFusionPass)
    assert inductor_config.post_grad_custom_post_pass is user  # options do not touch the global


def test_user_pass_still_runs_under_compile():
    user = UserPass()
    inductor_config.post_grad_custom_post_pass = user
    arfusion.enable()
    torch.compile(lambda x: x.sin() + 1)(torch.randn(4))
    assert user.calls == 1
    arfusion.disable()


def test_an_inference_aware_user_pass_gets_is_inference_through_the_chain():
    """A user's CustomInferenceAwareGraphPass set before enable(): Inductor hands `is_inference`
    only to a pass in its slot, so the chain takes it and passes it on."""
    from torch._inductor import custom_graph_pass

    aware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)
    if aware is None:
        pytest.skip("this torch has no inference-aware passes")

    class AwarePass(aware):
        def __init__(self):
            self.seen = []

        def __call__(self, graph, is_inference):
            self.seen.append(is_inference)

        def uuid(self):
            return "aware"

    user = AwarePass()
    inductor_config.post_grad_custom_post_pass = user
    arfusion.enable()
    try:
        with torch.no_grad():
            torch.compile(lambda x: x.sin() + 1)(torch.randn(4))
    finally:
        arfusion.disable()
    assert user.seen == [True]
    assert inductor_config.post_grad_custom_post_pass is user


def test_equal_chains_hash_alike():
    ours = ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True))
    a = ChainedPass([ours, ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True))])
    b = ChainedPass([ours, ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True))])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_disable_without_enable_is_harmless():
    arfusion.disable()
    assert inductor_config.post_grad_custom_post_pass is None


# ------------------------------------------------------------------ arfusion tune


def test_tune_without_a_gpu_or_flashinfer_says_why_before_the_process_group(monkeypatch, capsys):
    """Under torchrun on a machine that cannot tune: one line and exit 2, not a trace."""
    import torch.distributed as dist

    from arfusion import cli
    from arfusion.decisions import Reason, Why

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--hidden", "256"]) == 2
    assert capsys.readouterr().err == "arfusion tune: no CUDA GPU here; it times FlashInfer's kernels on NVIDIA GPUs\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "get_backend", lambda name: Reason(Why.NO_BACKEND, "FlashInfer is not installed"))
    assert cli.main(["tune", "--hidden", "256"]) == 2
    assert capsys.readouterr().err == "arfusion tune: FlashInfer cannot run here: FlashInfer is not installed\n"
    assert not dist.is_initialized()


# ------------------------------------------------------------------ cache keys


def test_uuid_is_stable_and_tracks_config_env_and_version(monkeypatch):
    base = ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True))
    assert base.uuid() == ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True)).uuid()
    other_backend = ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
    other_cap = ArFusionPass(arfusion.PassConfig(enable_allreduce_fusion=True, max_size_mb={4: 1}))
    assert len({base.uuid(), other_backend.uuid(), other_cap.uuid()}) == 3
    plain = base.uuid()
    monkeypatch.setenv("ARFUSION_DISABLE", "1")
    assert base.uuid() != plain
    monkeypatch.delenv("ARFUSION_DISABLE")
    monkeypatch.setattr("arfusion.fusion_pass.__version__", "9.9.9")
    assert base.uuid() != plain


def test_uuid_tracks_pattern_source(monkeypatch):
    before = ArFusionPass().uuid()
    monkeypatch.setattr("arfusion.fusion_pass._source_hash", lambda: "edited")
    assert ArFusionPass().uuid() != before


def test_chain_is_cacheable_only_if_every_pass_is():
    ours = ArFusionPass()
    assert ChainedPass([UserPass(), ours]).uuid() is not None
    assert ChainedPass([lambda g: None, ours]).uuid() is None


def test_warm_fx_graph_cache_hit_still_fuses_and_reports_the_same_sites(fake_pg):
    """A cached graph is served without running the pass; the op must not need it, and stats()
    must report the sites the graph carries, as after the cold compile."""
    from torch._inductor.utils import fresh_cache

    from .models import TinyDecoder

    model = TinyDecoder(64, layers=2)
    x = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), torch.no_grad():
        torch.compile(model, options=options)(x)
        cold = arfusion.stats()
        torch._dynamo.reset()
        arfusion.reset_stats()
        counters = torch._dynamo.utils.counters
        counters.clear()
        torch.compile(model, options=options)(x)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        warm = arfusion.stats()
    assert cold["fused_sites"] == 5 and cold["graphs"] == 1
    assert cold["unfused_sites"] == 0 and cold["why_not_codes"] == {}
    # The pass did not run (served from cache), yet the sites are counted and the fused op ran.
    assert warm["graphs"] == 0 and warm["pass_seconds"] == 0
    assert (warm["fused_sites"], warm["by_pattern"]) == (cold["fused_sites"], cold["by_pattern"])
    assert warm["dispatch"] == {"torch": 5}


def test_a_graph_from_the_cache_of_another_process_is_said_and_counted(fake_pg, caplog, monkeypatch):
    """A graph from the FX graph cache that the pass never met in this process (a rerun of a
    script): one INFO line says its reasons are not known, its fast-path all-reduce counts as
    unfused (not 0 beside a fast-path all-reduce), and graphs_from_cache counts it."""
    from torch._inductor.utils import fresh_cache

    from .models import LayerNormBlock

    model = LayerNormBlock(64)
    x, r = torch.randn(1, 4, 64, dtype=torch.bfloat16), torch.randn(1, 4, 64, dtype=torch.bfloat16)
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), torch.no_grad():
        torch.compile(model, options=options)(x, r)
        cold = arfusion.stats()
        torch._dynamo.reset()
        arfusion.reset_stats()
        monkeypatch.setattr(arfusion.stats, "_passed", set())  # as in a new process
        with caplog.at_level(logging.INFO, logger="arfusion"):
            torch.compile(model, options=options)(x, r)
        warm = arfusion.stats()
    assert cold["why_not_codes"] == {"layernorm": 1} and cold["unfused_sites"] == 1 and cold["graphs_from_cache"] == 0
    assert warm["graphs"] == 0 and warm["graphs_from_cache"] == 1
    assert warm["fast_path_all_reduces"] == warm["unfused_sites"] == 1 and warm["why_not_codes"] == {}
    assert caplog.text.count("FX graph cache") == 1
