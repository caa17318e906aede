"""Quantized all-reduce (opt-in): config, the codecs' numerics, gating at the crossover, the
fallback when FlashInfer's kernel or its symmetric memory is missing, and compiled models on
2 gloo ranks (the torch backend emulates the quantization)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

from arfusion import codec as codecs
from arfusion.backends import flashinfer as fi
from arfusion.backends import flashinfer_dispatch as dispatch
from arfusion.core import Call, Form
from arfusion.backends.torch_ref import TorchBackend
from arfusion.config import QUANTIZED_ENV, QUANTIZED_LEVELS, PassConfig
from arfusion.decisions import Why

from .helpers import collect_from_ranks

MiB = 1 << 20
BF16 = torch.bfloat16
SITE = Form(residual=True, norm="rms")


# ---------------------------------------------------------------- config


def test_config_levels_and_validation():
    assert PassConfig().quantized_allreduce is None
    assert PassConfig(quantized_allreduce="FP8").quantized_allreduce == "fp8"
    assert PassConfig(quantized_allreduce="none").quantized_allreduce is None
    with pytest.raises(ValueError, match="quantized_allreduce must be None or one of"):
        PassConfig(quantized_allreduce="int3")
    with pytest.raises(ValueError, match="quantized_allreduce_min_mb"):
        PassConfig(quantized_allreduce_min_mb={2: -1})
    config = PassConfig.from_dict({"pass_config": {"quantized_allreduce": "int4",
                                                   "quantized_allreduce_min_mb": {"2": 16}}})
    assert config.quantized_allreduce == "int4" and config.codec_min_bytes(2) == 16 * MiB
    assert config.codec_min_bytes(4) is None
    # The level is part of the cache key: a quantized graph is never served to an exact config.
    assert PassConfig(quantized_allreduce="fp8").key() != PassConfig().key()


def test_env_switch_applies_where_the_config_names_no_level(monkeypatch):
    monkeypatch.setenv(QUANTIZED_ENV, "int6")
    assert PassConfig().quantized_allreduce == "int6"
    assert PassConfig(quantized_allreduce="fp8").quantized_allreduce == "fp8"
    monkeypatch.setenv(QUANTIZED_ENV, "off")
    assert PassConfig().quantized_allreduce is None
    monkeypatch.setenv(QUANTIZED_ENV, "fp4")
    with pytest.raises(ValueError, match="'fp4'"):
        PassConfig()


# ---------------------------------------------------------------- codec numerics


@pytest.mark.parametrize("level", QUANTIZED_LEVELS)
def test_codec_error_is_bounded_per_group(level):
    codec = codecs.CODECS[level]
    torch.manual_seed(0)
    x = torch.randn(8, 1024, dtype=torch.float64)
    x[0, 5] = 300.0  # an outlier only coarsens its own group
    back = codecs.quantize_dequantize(x, codec).double()
    groups, back_groups = x.reshape(-1, codec.group), back.reshape(-1, codec.group)
    amax = groups.abs().amax(-1, keepdim=True)
    err = (back_groups - groups).abs()
    if codec.floating:  # e4m3: 3 mantissa bits, relative half-step 2^-4 (subnormals: absolute)
        bound = torch.maximum(groups.abs() * 2.0 ** -4, amax * 2.0 ** -9 / 448 * 2)
    else:  # integer steps of amax / L, L = 2^(bits-1); codes past L - 1 (values near -amax) clamp
        levels = 2 ** (codec.bits - 1)
        bound = amax / levels * torch.where(groups < -amax * (levels - 1) / levels, 1.0, 0.5)
    assert bool((err <= bound * (1 + 1e-4)).all())  # fp32 arithmetic
    outlier_group = 5 // codec.group
    others = torch.ones(groups.shape[0], dtype=torch.bool)
    others[outlier_group] = False
    assert err[others].max() < err[outlier_group].max()
    if not codec.floating:
        top = groups == amax  # +amax comes back as itself (in fp32, where the codec computes)
        assert bool((back_groups[top] == groups[top].float().double()).all())


def test_codecs_get_coarser_with_fewer_bits():
    torch.manual_seed(1)
    x = torch.randn(4096)
    errors = {lv: (codecs.quantize_dequantize(x, codecs.CODECS[lv]) - x).norm() / x.norm()
              for lv in ("int8", "int6", "int4")}
    assert errors["int8"] < errors["int6"] < errors["int4"] < 0.2


def test_flashinfer_stripes():
    owner = codecs.stripe_owner(3 * 4096 + 5, 2, torch.device("cpu"))
    assert owner[:4096].eq(0).all() and owner[4096:8192].eq(1).all() and owner[8192:].tolist()[0] == 0
    assert codecs.stripe_owner(300, 4, torch.device("cpu")).eq(0).all()  # one stripe: all of it
    big = 32 * 2 ** 20 + 8
    assert int(codecs.stripe_owner(big, 2, torch.device("cpu"))[16384]) == 1


# ---------------------------------------------------------------- gating at the crossover


@pytest.fixture
def h200(monkeypatch, tmp_path):
    """FlashInfer backend decisions as on an H200 (nothing here touches a GPU)."""
    monkeypatch.setattr(fi, "_environment_problem", lambda index: None)
    monkeypatch.setattr(fi, "device_facts", lambda index: fi.DeviceFacts((9, 0), "NVIDIA H200", "uuid"))
    monkeypatch.setenv(dispatch.CACHE_ENV, str(tmp_path / "tuning.json"))
    dispatch.forget_cache()
    yield fi.FlashInferBackend()
    dispatch.forget_cache()


def call(tokens, hidden=4096, world=2, dtype=BF16, device="cuda"):
    return Call(form=SITE, tokens=tokens, hidden=hidden, dtype=dtype, weight_dtype=dtype, world_size=world,
                device=torch.device(device, 0) if device == "cuda" else torch.device(device), group_name="g")


def tokens_for(mib, hidden=4096):
    return int(mib * MiB) // (hidden * 2)


@pytest.mark.parametrize("world, mib", [(2, 8), (4, 2)])  # the seeded crossovers, inclusive (4xH200, 2026-11-28)
def test_flashinfer_crossover_boundary(h200, world, mib):
    at = tokens_for(mib)  # 8 MiB: 1024 tokens x 4096 x 2 bytes
    assert h200.codec_why_not(call(at, world=world), "fp8") is None
    assert h200.codec_why_not(call(at - 1, world=world), "fp8").code is Why.BELOW_CROSSOVER
    assert h200.codec_why_not(call(tokens_for(64), world=world), "fp8") is None
    assert h200.codec_why_not(call(None), "fp8") is None  # dynamic: decided per call
    assert h200.codec_why_not(call(tokens_for(64) + 1), "fp8").code is Why.SIZE_CAP
    assert h200.codec_why_not(call(tokens_for(64)), "fp8") is None


@pytest.mark.parametrize("change, expected", [
    (dict(world=8), Why.NO_CROSSOVER),  # unmeasured: never guessed
    (dict(world=6), Why.WORLD_SIZE),
    (dict(dtype=torch.float16), Why.DTYPE),
    (dict(hidden=4100), Why.SHAPE),
])
def test_flashinfer_declines_what_it_cannot_run(h200, change, expected):
    args = dict(tokens=tokens_for(16, change.get("hidden", 4096)))
    args.update(change)
    reason = h200.codec_why_not(call(**args), "fp8")
    assert reason.code is expected
    if expected is Why.NO_CROSSOVER:  # says how to measure it, or what to set instead
        assert "--quantized" in reason.message and "quantized_allreduce_min_mb" in reason.message


def test_flashinfer_has_fp8_only(h200):
    assert h200.codec_why_not(call(4096), "int4").code is Why.NO_KERNEL


@pytest.mark.parametrize("world, mib, knobs", [
    (2, 4, {}),  # below the measured range: FlashInfer's own
    (2, 8, {"block_size": 16384}),
    (2, 12, {"block_size": 16384}),  # between two sizes measured: the smaller one's
    (2, 16, {"block_size": 16384, "p2p_phase3": True}),
    (2, 64, {"block_size": 16384, "p2p_phase3": True}),  # the largest quantized at all (QUANTIZED_MAX_BYTES)
    (4, 8, {}),  # TP=4 unmeasured: never guessed
])
def test_flashinfer_launch_knobs_come_from_the_measured_table(h200, monkeypatch, world, mib, knobs):
    """codec_all_reduce hands FlashInfer the table's knobs for the message's size, or none."""
    seen = []

    def quantized_all_reduce(inp, group, **kwargs):
        seen.append(kwargs)
        return inp

    monkeypatch.setitem(sys.modules, "flashinfer.comm.quantized_allreduce",
                        types.SimpleNamespace(quantized_all_reduce=quantized_all_reduce))
    monkeypatch.setattr(dist.distributed_c10d, "_resolve_process_group", lambda name: "group")
    x = torch.empty(int(mib * MiB) // 2, dtype=BF16, device="meta")
    h200.codec_all_reduce(call(None, world=world), x, "fp8")
    assert seen == [knobs]
    text = dispatch.codec_knobs_text(9, "NVIDIA H200", world, 4096, BF16)  # what the buffer's INFO line says
    assert ("from 8 MiB block_size=16384" in text) == (world == 2) and ("own" in text) == (world != 2)


def test_tuned_launch_knobs_win_over_the_table(h200, monkeypatch):
    """`arfusion tune --quantized fp8 --knobs` stores knob steps in tokens for (GPU, world, hidden,
    dtype); the op reads them before the table, also where the table has none (TP=4), and a step
    back to {} returns to FlashInfer's own knobs."""
    from arfusion import tuning

    seen = []
    monkeypatch.setitem(sys.modules, "flashinfer.comm.quantized_allreduce", types.SimpleNamespace(
        quantized_all_reduce=lambda inp, group, **kwargs: seen.append(kwargs) or inp))
    monkeypatch.setattr(dist.distributed_c10d, "_resolve_process_group", lambda name: "group")
    steps = [[256, {"block_size": 8192}], [2048, {"block_size": 16384, "p2p_phase3": True}], [8192, {}]]
    for world in (2, 4):
        tuning.save_entry(dispatch.tuned_key("NVIDIA H200", world, 4096, BF16),
                          {"max_fused_tokens": 1024, "oneshot_max_tokens": 256, "quantized_knobs": {"fp8": steps}},
                          dispatch.cache_path())
    dispatch.forget_cache()
    for world in (2, 4):
        for tokens in (128, 256, 1024, 2048, 4096, 8192):
            h200.codec_all_reduce(call(None, world=world), torch.empty(tokens, 4096, dtype=BF16, device="meta"), "fp8")
    assert seen == 2 * [{}, {"block_size": 8192}, {"block_size": 8192}, {"block_size": 16384, "p2p_phase3": True},
                        {"block_size": 16384, "p2p_phase3": True}, {}]
    text = dispatch.codec_knobs_text(9, "NVIDIA H200", 4, 4096, BF16)
    assert text.startswith("launch knobs from the tuned cache") and "from 2 MiB block_size=8192" in text
    assert "from 64 MiB FlashInfer's own" in text
    # another hidden size has no tuned entry: the table's (TP=2) or FlashInfer's own (TP=4)
    assert dispatch.codec_knobs(9, "NVIDIA H200", 4, 8192, BF16, 16 * MiB) == {}
    assert dispatch.codec_knobs(9, "NVIDIA H200", 2, 8192, BF16, 16 * MiB) == {"block_size": 16384, "p2p_phase3": True}


@pytest.mark.parametrize("dtype, world, says", [(torch.float16, 2, "bfloat16 only"), (BF16, 6, "power-of-two world")])
def test_tune_refuses_a_quantized_all_reduce_the_kernel_cannot_run_before_timing(h200, monkeypatch, dtype, world, says):
    """Otherwise the op would time its exact fallback as "quantized" (and --knobs would call
    FlashInfer with what it rejects), minutes into the run."""
    from arfusion import tuning

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(h200, "why_not", lambda call, max_bytes: None)  # the exact kernel could run
    monkeypatch.setattr(h200, "prepare", lambda call, max_bytes: None)
    monkeypatch.setattr(tuning, "get_backend", lambda name: h200)
    monkeypatch.setattr(tuning, "compiled_add_rms_norm", lambda: pytest.fail("timing started"))
    group = types.SimpleNamespace(group_name="g", size=lambda: world, rank=lambda: 0)
    with pytest.raises(RuntimeError, match=f"--quantized fp8: .*{says}"):
        tuning.tune(4096, dtype, tokens=[1024], group=group, quantized="fp8", knobs=True)
    with pytest.raises(ValueError, match="launch knobs are the quantized all-reduce's"):
        tuning.tune(4096, BF16, tokens=[1024], group=group, knobs=True)


def test_tune_picks_knobs_only_where_they_beat_flashinfers_own_by_the_margin():
    """tune's rows: FlashInfer's own knobs ({}) and each setting, slowest rank's µs; a setting is
    chosen where it is more than KNOB_MARGIN faster there and at a neighbouring count, a step
    wherever the choice changes."""
    from arfusion import tuning

    a, b = {"block_size": 16384, "p2p_phase3": False}, {"block_size": 16384, "p2p_phase3": True}
    times = {128: (10.0, 9.95, 10.5), 1024: (35.6, 33.7, 34.0), 1536: (55.9, 50.5, 51.0),
             2048: (71.5, 63.0, 61.9), 8192: (263.9, 263.0, 264.0)}  # own, a, b
    rows = [tuning.row_of(t, [50.0, 40.0, float("nan"), 45.0, 42.0, 99.0, *us], [{}, a, b])
            for t, us in times.items()]
    assert [r.twoshot_us for r in rows] == [None] * 5 and rows[0].plain_us == 42.0
    assert [r.quantized_us for r in rows] == [10.0, 35.6, 55.9, 71.5, 263.9]  # FlashInfer's own, until chosen
    steps = tuning.choose_knobs(rows)
    assert steps == [[1024, a], [2048, b], [8192, {}]]  # 128: 0.5% faster is not enough
    assert [r.quantized_us for r in rows] == [10.0, 33.7, 50.5, 61.9, 263.9]  # the chosen setting's time
    assert tuning.choose_knobs(rows, margin=0.0) == [[128, a], [2048, b], [8192, a]]
    plain = tuning.row_of(64, [50.0, 40.0, 41.0, 45.0, 42.0, 30.0])  # no sweep: the op's quantized time
    assert plain.knobs_us is None and plain.quantized_us == 30.0 and tuning.choose_knobs([plain]) == []
    entry = {"max_fused_tokens": 0, "oneshot_max_tokens": 0, "quantized_min_tokens": {"fp8": 1024},
             "quantized_knobs": {"fp8": steps}, "measured": [dataclasses.asdict(r) for r in rows]}
    assert ("fp8 launch knobs: from 1024 tokens block_size=16384, p2p_phase3=False; from 2048 tokens "
            "block_size=16384, p2p_phase3=True; from 8192 tokens FlashInfer's own") in tuning.format_rows(entry)
    assert len(dispatch.knob_combinations(dispatch.TUNE_KNOBS)) == 6


def test_tune_takes_a_win_at_one_token_count_alone_for_noise():
    """4xH200, TP=4 (2026-11-28): block 4096 with P2P phase 3 was 5.5% faster than FlashInfer's own
    at 512 tokens and 6.7% / 4.1% slower at 256 / 1024; a lone win sets no step, nor does a count
    with no measured neighbour."""
    from arfusion import tuning

    c = {"block_size": 4096, "p2p_phase3": True}
    times = {256: (21.4, 22.8), 512: (28.2, 26.6), 1024: (47.0, 48.9)}  # own, c (µs, slowest rank)
    rows = [tuning.row_of(t, [50.0, 40.0, 41.0, 45.0, 42.0, 99.0, *us], [{}, c]) for t, us in times.items()]
    assert tuning.knob_choices(rows)[512] == ({}, 28.2)
    assert tuning.choose_knobs(rows) == [] and rows[1].quantized_us == 28.2
    assert tuning.choose_knobs(rows[1:2]) == []
    rows[2].knobs_us[1][1] = 45.0  # c wins at 1024 too: now both counts take it
    assert tuning.choose_knobs(rows) == [[512, c]]


def test_user_threshold_and_tuned_cache_override_the_table(h200, tmp_path):
    assert h200.codec_why_not(call(tokens_for(1)), "fp8", min_bytes_override=0) is None
    assert h200.codec_why_not(call(tokens_for(16)), "fp8", min_bytes_override=32 * MiB).code is Why.BELOW_CROSSOVER
    key = dispatch.tuned_key("NVIDIA H200", 4, 4096, BF16)
    entry = {"max_fused_tokens": 1024, "oneshot_max_tokens": 256, "quantized_min_tokens": {"fp8": 2048}}
    (tmp_path / "tuning.json").write_text(json.dumps({"version": dispatch.CACHE_VERSION, "entries": {key: entry}}))
    dispatch.forget_cache()
    assert h200.codec_why_not(call(2048, world=4), "fp8") is None
    assert h200.codec_why_not(call(2047, world=4), "fp8").code is Why.BELOW_CROSSOVER
    entry["quantized_min_tokens"] = {"fp8": None}
    (tmp_path / "tuning.json").write_text(json.dumps({"version": dispatch.CACHE_VERSION, "entries": {key: entry}}))
    dispatch.forget_cache()
    assert h200.codec_why_not(call(8192, world=4), "fp8").code is Why.NO_CROSSOVER


def test_torch_backend_emulates_at_every_size():
    backend = TorchBackend()
    for level in QUANTIZED_LEVELS:
        assert backend.codec_why_not(call(1, device="cpu"), level) is None
    assert backend.codec_why_not(call(1, device="cpu"), "fp8", min_bytes_override=MiB).code is Why.BELOW_CROSSOVER


# ---------------------------------------------------------------- gloo workers (one spawn)


class OneSite(torch.nn.Module):
    """Row-parallel matmul -> all-reduce -> + residual -> RMSNorm (HF Llama spelling)."""

    def __init__(self, hidden, dtype=BF16):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(hidden, hidden, dtype=dtype) / math.sqrt(hidden))
        self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=dtype))

    def forward(self, x, residual):
        y = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x @ self.w, "sum", dist.group.WORLD.group_name))
        h = residual + y
        hf = h.float()
        return self.g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), h


def _compiled(model, config, dynamic=False):
    import arfusion

    torch._dynamo.reset()
    return torch.compile(model, options=arfusion.inductor_options(config), dynamic=dynamic)


def _end_to_end(rank, out):
    import arfusion
    from arfusion import reference

    hidden = 256
    torch.manual_seed(0)
    model = OneSite(hidden)
    torch.manual_seed(10 + rank)
    x, res = torch.randn(6, hidden, dtype=BF16), torch.randn(6, hidden, dtype=BF16)
    group = dist.group.WORLD.group_name
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        exact_norm, exact_h = model(x, res)
        for level in QUANTIZED_LEVELS:
            arfusion.reset_stats()
            config = PassConfig(enable_allreduce_fusion=True, backend="torch", quantized_allreduce=level)
            norm, h = _compiled(model, config)(x, res)
            # What the op must compute: the emulated all-reduce of the same matmul, then the norm.
            want_h = res + codecs.emulate(x @ model.w, group, level)
            want_norm = reference.rms_norm(want_h, model.g, 1e-6, "rms")
            out[level] = dict(
                stats=arfusion.stats(),
                vs_emulation=float((h.float() - want_h.float()).abs().max()),
                norm_vs_emulation=float((norm.float() - want_norm.float()).abs().max()),
                vs_exact=float((h.float() - exact_h.float()).abs().max() / exact_h.float().abs().max()),
                norm_vs_exact=float((norm.float() - exact_norm.float()).abs().max()))

        # The user's threshold, static shapes: 6 x 256 x 2 = 3072 bytes per rank (inclusive).
        for mb, name in ((3072 / MiB, "at_threshold"), (3073 / MiB, "below_threshold")):
            arfusion.reset_stats()
            config = PassConfig(enable_allreduce_fusion=True, backend="torch", quantized_allreduce="fp8",
                                quantized_allreduce_min_mb={2: mb})
            norm, _ = _compiled(model, config)(x, res)
            out[name] = dict(stats=arfusion.stats(), exact=bool(torch.equal(norm, exact_norm)))
        # dynamic=True: chosen per call inside the op, by the same rule on every rank.
        arfusion.reset_stats()
        config = PassConfig(enable_allreduce_fusion=True, backend="torch", quantized_allreduce="int8",
                            quantized_allreduce_min_mb={2: 4 * hidden * 2 / MiB})
        fn = _compiled(model, config, dynamic=True)
        small, large = fn(x[:3], res[:3])[0], fn(x, res)[0]
        out["dynamic"] = dict(stats=arfusion.stats(), small_exact=bool(torch.equal(small, model(x[:3], res[:3])[0])),
                              large_exact=bool(torch.equal(large, exact_norm)))

        # Ranks agree except in each other's stripes (FlashInfer's fp8 two-shot).
        y = torch.randn(3 * 4096, dtype=torch.float32) * (1 + rank)
        got = codecs.emulate(y, group, "fp8")
        gathered = [torch.empty_like(got) for _ in range(2)]
        dist.all_gather(gathered, got)
        total = y.clone()
        dist.all_reduce(total)
        owner = codecs.stripe_owner(y.numel(), 2, y.device)
        out["stripes"] = dict(
            own_exact_vs_fp8_sum=float((got[owner == rank] - _sum_of_quantized(y, group)[owner == rank]).abs().max()),
            others_differ=bool((gathered[0] != gathered[1]).any()),
            rel_err=float((got - total).norm() / total.norm()))


def _sum_of_quantized(y, group):
    sent = codecs.quantize_dequantize(y, codecs.CODECS["fp8"])
    dist.all_reduce(sent)
    return sent


def _fallback_when_missing(rank, out):
    """FlashInfer's prepare on gloo/CPU with the module missing on one rank, then raising on one."""
    from arfusion.backends.flashinfer import FlashInferBackend

    c = Call(form=SITE, tokens=4, hidden=64, dtype=BF16, weight_dtype=BF16, world_size=2,
             device=torch.device("cpu"), group_name=dist.group.WORLD.group_name)
    name = "flashinfer.comm.quantized_allreduce"
    saved = sys.modules.get(name)
    try:
        sys.modules[name] = None if rank == 1 else types.SimpleNamespace()  # None: import fails
        backend = FlashInferBackend()
        missing = [backend.prepare_codec(c, "fp8"), backend.prepare_codec(c, "fp8")]
        out["missing"] = [missing[0] and missing[0].code.value, missing[0] == missing[1]]

        calls = []

        def quantized_all_reduce(inp, group, output=None):
            calls.append(inp.numel())
            if rank == 0:
                raise RuntimeError("symmetric memory unavailable")
            return output

        sys.modules[name] = types.SimpleNamespace(quantized_all_reduce=quantized_all_reduce)
        backend = FlashInferBackend()
        raising = backend.prepare_codec(c, "fp8")
        out["raising"] = [raising and raising.code.value, calls]
        # torch's symmetric memory setting before, while FlashInfer makes its buffer, and after.
        seen = [os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")]
        sys.modules[name] = types.SimpleNamespace(quantized_all_reduce=lambda inp, group, output=None: seen.append(
            os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")) or output)
        backend = FlashInferBackend()
        out["ok"] = [backend.prepare_codec(c, "fp8"), backend._codecs[c.group_name].ready]
        out["multicast_env"] = [*seen, os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")]
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def _all_cases(rank):
    out = {}
    for case in (_end_to_end, _fallback_when_missing):
        case(rank, out)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect_from_ranks(_all_cases, 2, tmp_path_factory.mktemp("quantized"))


@pytest.mark.parametrize("level", QUANTIZED_LEVELS)
@pytest.mark.multiproc
@pytest.mark.slow
def test_compiled_model_runs_the_quantized_all_reduce(results, level):
    for r in results:
        got = r[level]
        assert got["stats"]["fused_sites"] == 1
        assert got["stats"]["dispatch"] == {f"torch quantized {level}": 1}
        assert got["vs_emulation"] == 0.0  # the op computes exactly the emulation + the model's norm
        assert got["norm_vs_emulation"] == 0.0
        assert 0 < got["vs_exact"] < {"fp8": 0.08, "int8": 0.03, "int6": 0.08, "int4": 0.3}[level]


@pytest.mark.multiproc
@pytest.mark.slow
def test_threshold_boundary_static_shapes(results):
    for r in results:
        assert r["at_threshold"]["stats"]["dispatch"] == {"torch quantized fp8": 1}
        assert not r["at_threshold"]["exact"]
        assert r["below_threshold"]["stats"]["dispatch"] == {"torch": 1}
        assert r["below_threshold"]["exact"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_run_time_choice_with_dynamic_shapes(results):
    for r in results:
        assert r["dynamic"]["stats"]["dispatch"] == {"torch": 1, "torch quantized int8": 1}
        assert r["dynamic"]["small_exact"] and not r["dynamic"]["large_exact"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_emulated_fp8_keeps_each_ranks_own_stripe_exact(results):
    for r in results:
        assert r["stripes"]["own_exact_vs_fp8_sum"] == 0.0
        assert 0 < r["stripes"]["rel_err"] < 0.05
    assert results[0]["stripes"]["others_differ"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_missing_library_or_symmetric_memory_falls_back_on_every_rank(results):
    for r in results:
        # Missing on rank 1 only: both ranks decline, once (the second call gives the same reason).
        assert r["missing"] == ["runtime", True]
        code, calls = r["raising"]
        assert code == "runtime"  # raising on rank 0 only: both decline
        assert calls == [dispatch.QUANTIZED_MAX_BYTES // 2]  # one warm-up at the largest size
        assert r["ok"] == [None, True]
        before, during, after = r["multicast_env"]
        assert during == "1" and after == before  # never NVLink multicast; the process's setting kept
