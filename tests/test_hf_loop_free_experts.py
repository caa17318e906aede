"""arfusion.hf.loop_free_experts: LongCat-Flash's looped experts, without the loop.

The looped forward walks the experts hit with `nonzero` and `.item()` (a graph break per MoE
layer); the loop-free one must compute the same sum: routed experts through grouped GEMMs,
identity ("zero") experts passing the token through, the top-k weights applied. Under tensor
parallelism (tests/test_hf_coverage.py, 2 gloo ranks) the TP wrapper around the forward must keep
its transforms; here a stand-in wrapper shaped as transformers' is checked.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")

from arfusion import hf  # noqa: E402
from arfusion.hf.configs import tiny_config  # noqa: E402

from .models import experts_sum_float64, looped_longcat_experts  # noqa: E402


TOKENS = 24


needs_looped_experts = pytest.mark.skipif(not looped_longcat_experts(), reason=(
    "the installed transformers' LongCat-Flash experts have no loop (transformers >= 5.25): "
    "run this file with transformers 5.24 (.ci/run does)"))


def test_a_model_without_looped_experts_is_left_as_it_is():
    """Where no module holds looped experts (Llama; LongCat-Flash on transformers >= 5.25), nothing changes."""
    from transformers import AutoModelForCausalLM

    for model_type in ("llama", "longcat_flash"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16)
        looped = model_type == "longcat_flash" and looped_longcat_experts()
        assert hf.loop_free_experts(model) == (model.config.num_layers if looped else 0)


def _longcat():
    from transformers import AutoModelForCausalLM

    config = tiny_config("longcat_flash")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return model, config


def _experts(model):
    return [m for m in model.modules() if type(m).__name__ == "LongcatFlashExperts"]


def _routing(experts, config, seed=1):
    """Top-k choices over routed and identity experts (each token's k distinct), weights in fp32 as
    LongCat's router gives them, and bf16 activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, config.hidden_size, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(experts.total_experts, generator=g)[:config.moe_topk] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, config.moe_topk, generator=g)
    return x, index, weights


@needs_looped_experts
def test_the_loop_free_sum_is_the_looped_one_or_nearer_the_exact_one():
    """The loop rounds to bf16 after each expert's index_add_; the loop-free forward sums the
    weighted rows in fp32 and rounds once: against float64, never worse than the loop by more
    than the last rounding, and within a few bf16 ulp of it."""
    model, config = _longcat()
    experts = _experts(model)[0]
    x, index, weights = _routing(experts, config)
    assert (index >= experts.num_routed_experts).any() and (index < experts.num_routed_experts).any()
    with torch.no_grad():
        looped = experts(x, index, weights).double()
        assert hf.loop_free_experts(model) == len(_experts(model)) == config.num_layers
        loop_free = experts(x, index, weights).double()
    exact = experts_sum_float64(experts, x, index, weights)
    scale = exact.abs().max()
    err_loop, err_ours = ((looped - exact).abs().max() / scale).item(), ((loop_free - exact).abs().max() / scale).item()
    assert err_ours <= err_loop + 2 ** -9, (err_ours, err_loop)
    assert ((loop_free - looped).abs().max() / scale).item() <= 4 * 2 ** -8


@needs_looped_experts
def test_no_tokens_gives_zeros():
    model, config = _longcat()
    experts = _experts(model)[0]
    hf.loop_free_experts(model)
    x = torch.zeros(0, config.hidden_size, dtype=torch.bfloat16)
    out = experts(x, torch.zeros(0, config.moe_topk, dtype=torch.long), torch.zeros(0, config.moe_topk))
    assert out.shape == x.shape


@needs_looped_experts
@pytest.mark.slow
def test_the_model_traces_whole_and_matches_eager():
    """One graph (Dynamo) that AOT autograd traces and runs as eager does. Inductor's kernels for
    it, at TP=2 with and without the pass, are the HF coverage sweep's LongCat-Flash row
    (tests/test_hf_coverage.py: one graph, logits within 2e-2 of eager)."""
    model, config = _longcat()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
        with pytest.raises(Exception, match="nonzero|data-dependent|Dynamic shape|item"):
            torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, use_cache=False)  # the loop
        torch._dynamo.reset()
        assert hf.prepare_for_compile(model)["experts_made_loop_free"] == config.num_layers
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, use_cache=False).logits.float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def _tp_style_wrapper(module, calls):
    """What transformers' TensorParallelLayer.install_forward does: a closure over the forward it
    replaced, named `original_forward`, with input and output transforms around it."""
    original_forward = module.forward

    def tp_forward(*args, **kwargs):
        calls.append("in")
        output = original_forward(*args, **kwargs)
        calls.append("out")
        return output * 1  # stands in for the experts' all-reduce

    module.forward = tp_forward


@needs_looped_experts
def test_the_forward_is_replaced_under_the_tp_wrapper_which_still_runs():
    model, config = _longcat()
    experts = _experts(model)
    calls = []
    for module in experts:
        _tp_style_wrapper(module, calls)
    wrappers = [m.forward for m in experts]
    assert hf.loop_free_experts(model) == len(experts)
    assert [m.forward for m in experts] == wrappers  # the wrappers stay; what they call changed
    x, index, weights = _routing(experts[0], config)
    with torch.no_grad():
        out = experts[0](x, index, weights)
    assert calls == ["in", "out"]
    torch.compile(lambda *a: experts[0](*a), fullgraph=True)(x, index, weights)  # no loop left inside
    assert out.shape == x.shape


@needs_looped_experts
def test_an_unknown_wrapper_is_left_alone(caplog):
    model, _ = _longcat()
    experts = _experts(model)
    for module in experts:
        inner = module.forward
        module.forward = lambda *a, _inner=inner, **k: _inner(*a, **k)  # no `original_forward` to find
    with caplog.at_level("INFO", logger="arfusion"):
        assert hf.loop_free_experts(model) == 0
    assert "keeps its looped forward" in caplog.text


@needs_looped_experts
def test_weights_without_a_grouped_gemm_keep_the_loop(caplog):
    """fp32 weights: torch's grouped GEMM (as torch.compile traces it) takes bf16 only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("longcat_flash"), dtype=torch.float32).eval()
    with caplog.at_level("INFO", logger="arfusion"):
        assert hf.loop_free_experts(model) == 0
    assert "no grouped GEMM for its torch.float32 weights" in caplog.text
