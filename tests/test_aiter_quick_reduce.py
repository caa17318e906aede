"""The aiter backend's quantized all-reduce (aiter's quick all-reduce, "quickreduce"), on CPU.

Like tests/test_aiter_backend.py, this checks arfusion's side only: which calls are made into
aiter, with which arguments, in which order, and which calls are declined. aiter is replaced by
tests/fake_aiter.py, written from the documented signatures of amd-aiter 0.1.7.post2.dev18 and
ROCm/aiter main. Nothing here has run on ROCm hardware or any aiter kernel, and the thresholds
tested are aiter's own, not measured by arfusion.
"""

from __future__ import annotations

import enum
import gc
import logging
import sys

import pytest
import torch
import torch.distributed as dist

import arfusion.ops
from arfusion import policy, reference, runtime
from arfusion.backends.aiter import AiterBackend, communicator, detection, limits, quick_reduce
from arfusion.backends.aiter import backend as aiter_backend
from arfusion.core import Call
from arfusion.decisions import Why

from .fake_aiter import CUDA, GROUP, QR_DEFAULT_MAX, V017, V_MAIN, V_STAGE, FakeAiter, call, simulate_rocm
from .helpers import collect_from_ranks

MIB = 1024 * 1024
BF16, FP16 = torch.bfloat16, torch.float16
GLOO = f"gloo:pg:{GROUP}"


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    for name in (limits.QUICK_REDUCE_CAST_ENV, limits.QUICK_REDUCE_MAX_SIZE_ENV):
        monkeypatch.delenv(name, raising=False)
    detection.detect.cache_clear()
    quick_reduce.quick_reduce_api.cache_clear()
    communicator._gloo_groups.clear()
    arfusion.runtime._logged.clear()
    yield
    detection.detect.cache_clear()
    quick_reduce.quick_reduce_api.cache_clear()


@pytest.fixture
def qr_env(monkeypatch):
    """simulate_rocm, with this one process standing in for every rank of the group.

    peer_ok: what the other ranks report at the first check (step 1); peer_host: their host;
    peer_agree: what they report at the next agreements (init, handle exchange), then True.
    """

    def setup(version=V_MAIN, arch="gfx942", world_size=2, peer_ok=True, peer_host=None,
              peer_agree=(True, True), **fake_kwargs):
        fake = FakeAiter(version=version, world_size=world_size, fp8=limits.LIMITS.fp8_dtypes[arch], **fake_kwargs)
        simulate_rocm(monkeypatch, arch, fake)
        monkeypatch.setattr(communicator, "resolve", lambda name: f"pg:{name}")
        monkeypatch.setattr(communicator, "gloo_twin", lambda group: f"gloo:{group}")
        monkeypatch.setattr(runtime, "capturing", lambda: False)
        monkeypatch.setattr(quick_reduce, "_rank_and_size", lambda group: fake.calls.append(("rank_and_size", (group,), {}))
                            or (0, world_size))
        agreements = list(peer_agree)

        def gather(values, group):
            fake.calls.append(("gather", (values, group), {}))
            peer = [1 if peer_ok else 0, values[1] if peer_host is None else peer_host]
            return [values] + [peer] * (world_size - 1)

        def agree(ok, group):
            fake.calls.append(("agree", (ok, group), {}))
            return ok and (agreements.pop(0) if agreements else True)

        monkeypatch.setattr(quick_reduce, "_gather_ints", gather)
        monkeypatch.setattr(quick_reduce, "_all_agree", agree)
        monkeypatch.setattr(dist, "all_gather_object", fake.simulated_all_gather_object)
        monkeypatch.setattr(reference, "all_reduce_sum", lambda x, group: fake.reduce(x))
        return fake

    return setup


def qr_names(fake: FakeAiter) -> list[str]:
    return [n for n in fake.names() if n.startswith(("init_custom_qr", "qr_"))]


def sized(nbytes: int, dtype=BF16, world_size=2, hidden=4096) -> Call:
    """A call of exactly `nbytes` per rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert nbytes % (hidden * itemsize) == 0
    return call(tokens=nbytes // (hidden * itemsize), hidden=hidden, dtype=dtype, world_size=world_size)


# ---------------------------------------------------------------- levels


@pytest.mark.parametrize("version", [V017, V_MAIN])
def test_levels_are_read_from_the_installed_enum(qr_env, version):
    qr_env(version)
    api = quick_reduce.quick_reduce_api()
    assert api.levels == {"fp8": 1, "int6": 2, "int4": 3}
    assert api.exchange == {V017: "tensors", V_MAIN: "helper"}[version]


def test_levels_follow_the_enum_by_name_not_by_number(qr_env, monkeypatch):
    qr_env(V_MAIN)
    shuffled = enum.Enum("QuickReduceRegime", {"FP": 0, "INT4": 1, "INT6": 7, "FP8": 5, "NONE": 9})
    monkeypatch.setattr(sys.modules[limits.QUICK_REDUCE_MODULE], "QuickReduceRegime", shuffled)
    assert quick_reduce.quick_reduce_api().levels == {"fp8": 5, "int6": 7, "int4": 1}


def test_a_level_missing_from_the_enum_is_declined(qr_env, monkeypatch):
    qr_env(V017)
    monkeypatch.setattr(sys.modules[limits.QUICK_REDUCE_MODULE], "QuickReduceRegime",
                        enum.Enum("QuickReduceRegime", {"FP": 0, "FP8": 1, "INT4": 3, "NONE": 4}))
    backend = AiterBackend()
    assert backend.codec_why_not(sized(64 * MIB), "int6").code is Why.NO_KERNEL
    assert backend.codec_why_not(sized(64 * MIB), "int4") is None


def test_int8_is_declined_with_the_reason():
    backend = AiterBackend()
    assert backend.capabilities.codecs == frozenset({"fp8", "int6", "int4"})
    reason = backend.codec_why_not(sized(64 * MIB), "int8")  # before any ROCm check
    assert reason.code is Why.NO_KERNEL


def test_an_aiter_without_quick_reduce_is_declined(qr_env):
    qr_env(V_STAGE)  # the fake gives this version no quick all-reduce
    reason = AiterBackend().codec_why_not(sized(64 * MIB), "int4")
    assert reason.code is Why.NO_KERNEL and "init_custom_qr" in reason.message  # names what is missing


def test_not_rocm_is_declined():
    reason = AiterBackend().codec_why_not(sized(64 * MIB), "fp8")
    assert reason.code is Why.NO_BACKEND


# ---------------------------------------------------------------- crossover (aiter's own table)

# QuickAllReduce._QR_MIN_SIZE of amd-aiter 0.1.7, MiB, [FP8, INT6, INT4] by (kernel dtype, world):
# written out again here so the test does not read the table it checks.
AITER_MIN_MIB = {
    (FP16, 2): (2, 2, 1), (FP16, 4): (16, 4, 2), (FP16, 8): (4, 4, 2),
    (BF16, 2): (8, 8, 8), (BF16, 4): (64, 64, 16), (BF16, 8): (2048, 2048, 2048),
}
CASES = [(dtype, cast, world, level)
         for dtype, cast in [(FP16, None), (FP16, "0"), (BF16, None), (BF16, "1"), (BF16, "0")]
         for world in (2, 4, 8) for level in ("fp8", "int6", "int4")]


@pytest.mark.parametrize("dtype, cast, world, level", CASES)
def test_crossover_is_aiters_threshold_inclusive(qr_env, monkeypatch, dtype, cast, world, level):
    qr_env(V_MAIN, world_size=world)
    if cast is not None:
        monkeypatch.setenv(limits.QUICK_REDUCE_CAST_ENV, cast)
    kernel = FP16 if dtype == FP16 or cast != "0" else BF16
    floor = AITER_MIN_MIB[(kernel, world)][("fp8", "int6", "int4").index(level)] * MIB
    backend = AiterBackend()
    at, below = sized(floor, dtype, world), sized(floor - 8192, dtype, world)
    assert backend.codec_why_not(at, level) is None
    reason = backend.codec_why_not(below, level)
    assert reason.code is Why.BELOW_CROSSOVER
    assert str(floor) in reason.message and "_QR_MIN_SIZE" in reason.message  # the number and its source
    assert backend.codec_min_bytes(at, level)[0] == floor
    # Tokens unknown at compile time: decided at run time.
    assert backend.codec_why_not(Call(**{**at.__dict__, "tokens": None}), level) is None


def test_user_threshold_overrides_aiters(qr_env):
    qr_env(V_MAIN)
    backend = AiterBackend()
    assert backend.codec_why_not(sized(MIB // 2), "int4").code is Why.BELOW_CROSSOVER  # aiter's 1 MiB
    assert backend.codec_why_not(sized(MIB // 2), "int4", min_bytes_override=MIB // 2) is None
    reason = backend.codec_why_not(sized(MIB // 4), "int4", MIB // 2)
    assert reason.code is Why.BELOW_CROSSOVER and "quantized_allreduce_min_mb" in reason.message  # names the knob


# ---------------------------------------------------------------- what the kernel cannot take


@pytest.mark.parametrize("world", [1, 3, 6, 16])
def test_world_sizes_other_than_2_4_8_are_declined(qr_env, world):
    qr_env(V_MAIN)
    reason = AiterBackend().codec_why_not(sized(64 * MIB, world_size=world), "int4", 0)
    assert reason.code is Why.WORLD_SIZE


def test_float32_is_declined(qr_env):
    qr_env(V_MAIN)
    assert AiterBackend().codec_why_not(sized(64 * MIB, torch.float32), "fp8", 0).code is Why.DTYPE


@pytest.mark.parametrize("tokens, ok", [(3, False), (4, True), (5, False), (6, True), (0, False)])
def test_bytes_must_be_a_multiple_of_16(qr_env, tokens, ok):
    qr_env(V_MAIN)
    c = call(tokens=tokens, hidden=4, dtype=FP16)  # 8 bytes a token
    reason = AiterBackend().codec_why_not(c, "int4", min_bytes_override=0)
    assert (reason is None) == ok, reason
    if not ok:
        assert reason.code is Why.SHAPE


def test_largest_message_default_and_from_aiters_env(qr_env, monkeypatch):
    qr_env(V_MAIN, world_size=2)
    assert limits.LIMITS.quick_reduce_default_max_bytes == QR_DEFAULT_MAX == 2048 * MIB  # aiter's qr_max_size()
    backend = AiterBackend()
    at_max = sized(2048 * MIB, FP16)
    assert backend.codec_why_not(at_max, "int4") is None  # inclusive, as aiter's `<=`
    assert backend.codec_why_not(sized(2048 * MIB + 8192, FP16), "int4").code is Why.SIZE_CAP
    monkeypatch.setenv(limits.QUICK_REDUCE_MAX_SIZE_ENV, "256")
    assert backend.codec_why_not(sized(256 * MIB, FP16), "int4") is None
    assert backend.codec_why_not(sized(256 * MIB + 8192, FP16), "int4").code is Why.SIZE_CAP


@pytest.mark.parametrize("name, value", [("CAST", "yes"), ("MAX_SIZE", "1.5")])
def test_unreadable_aiter_env_is_declined(qr_env, monkeypatch, name, value):
    qr_env(V_MAIN)
    env = {"CAST": limits.QUICK_REDUCE_CAST_ENV, "MAX_SIZE": limits.QUICK_REDUCE_MAX_SIZE_ENV}[name]
    monkeypatch.setenv(env, value)
    reason = AiterBackend().codec_why_not(sized(64 * MIB), "int4")
    assert reason.code is Why.NO_BACKEND and env in reason.message  # names the variable


# ---------------------------------------------------------------- set-up


def test_a_recreated_group_sets_up_again(qr_env, monkeypatch):
    """The same name resolving to a new ProcessGroup (destroyed and re-created) gets its own quick
    all-reduce: the old one's buffers hold the old peers' handles. Failed before the fix."""
    fake = qr_env(V_MAIN)
    live = {"tp0": object()}
    monkeypatch.setattr(communicator, "resolve", lambda name: live[name])
    backend = AiterBackend()
    c = sized(64 * MIB)
    assert backend.prepare_codec(c, "fp8") is None
    assert backend.prepare_codec(c, "fp8") is None
    live["tp0"] = object()
    assert backend.prepare_codec(c, "fp8") is None
    assert qr_names(fake).count("init_custom_qr") == 2
    backend.close()
    assert sum(comm["destroyed"] for comm in fake.qr_comms.values()) == 2  # the replaced one too


def test_groups_of_the_same_ranks_share_one_quick_reduce(qr_env, monkeypatch):
    """An expert-parallel group of the TP group's ranks (transformers >= 5.25) sets up nothing more."""
    fake = qr_env(V_MAIN)
    live = {"tp0": "pg:tp0", "ep0": "pg:ep0", "tp1": "pg:tp1"}
    ranks = {"pg:tp0": [0, 1], "pg:ep0": [0, 1], "pg:tp1": [2, 3]}
    monkeypatch.setattr(communicator, "resolve", lambda name: live[name])
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: ranks[group])
    backend = AiterBackend()
    for name in ("tp0", "ep0", "tp1"):
        assert backend.prepare_codec(Call(**{**sized(64 * MIB).__dict__, "group_name": name}), "fp8") is None
    assert qr_names(fake).count("init_custom_qr") == 2  # tp0 and ep0 share; tp1, other ranks, has its own
    backend.close()
    assert sum(comm["destroyed"] for comm in fake.qr_comms.values()) == 2  # each once


@pytest.mark.parametrize("version", [V017, V_MAIN])
def test_set_up_once_per_group_with_the_versions_handle_exchange(qr_env, version):
    fake = qr_env(version, world_size=4)
    backend = AiterBackend()
    c = sized(64 * MIB, world_size=4)
    assert backend.prepare_codec(c, "int4") is None
    assert backend.prepare_codec(c, "fp8") is None  # one communicator serves every level
    if version == V017:
        assert qr_names(fake) == ["init_custom_qr", "qr_get_handle", "qr_open_handles"]
        get, open_ = fake.calls[fake.names().index("qr_get_handle")], fake.calls[fake.names().index("qr_open_handles")]
        assert len(get[1]) == 1 and get[2] == {}
        handles = open_[1][1]
        assert len(handles) == 4 and all(isinstance(h, torch.Tensor) for h in handles)
    else:
        assert qr_names(fake) == ["init_custom_qr", "qr_exchange_handles", "qr_get_handle", "qr_open_handles"]
        exchange = fake.calls[fake.names().index("qr_exchange_handles")]
        assert exchange[1][1:] == (4, GLOO)
        get, open_ = fake.calls[fake.names().index("qr_get_handle")], fake.calls[fake.names().index("qr_open_handles")]
        assert len(get[1]) == 2 and isinstance(get[1][1], int)
        assert all(isinstance(h, int) for h in open_[1][1]) and len(open_[1][1]) == 4
        assert exchange[1][0] == get[1][0] == open_[1][0] == next(iter(fake.qr_comms))
    init = fake.calls[fake.names().index("init_custom_qr")]
    assert init[1] == (0, 4, None) and init[2] == {}  # rank, world size, aiter's default size
    # Every collective ran on the gloo twin, and in this order.
    assert [n for n in fake.names() if n in ("gather", "agree", "all_gather_object")] == [
        "gather", "agree", "all_gather_object", "agree"]
    assert {args[-1] for name, args, _ in fake.calls if name in ("gather", "agree", "all_gather_object")} == {GLOO}
    comm = next(iter(fake.qr_comms.values()))
    assert comm["opened"] and not comm["destroyed"]
    # Another group gets its own.
    other = Call(**{**c.__dict__, "group_name": "tp1"})
    assert backend.prepare_codec(other, "int4") is None
    assert qr_names(fake).count("init_custom_qr") == 2
    assert fake.violations == []


def test_max_size_from_aiters_env_goes_to_init(qr_env, monkeypatch):
    fake = qr_env(V017)
    monkeypatch.setenv(limits.QUICK_REDUCE_MAX_SIZE_ENV, "512")
    assert AiterBackend().prepare_codec(sized(64 * MIB), "int4") is None
    assert fake.calls[fake.names().index("init_custom_qr")][1] == (0, 2, 512 * MIB)


FAILURES = [
    # (fake / peer set-up, what goes wrong (the test's id), the local communicator's fate); every
    # one is a run-time refusal (Why.RUNTIME), given once and kept
    (dict(behaviour={"init_custom_qr": "raise"}), "aiter init_custom_qr failed: RuntimeError", None),
    (dict(peer_agree=(False,)), "aiter init_custom_qr failed: on another rank", "leaked"),
    (dict(behaviour={"qr_open_handles": "raise"}), "aiter quick all-reduce handle exchange failed: RuntimeError",
     "leaked"),
    (dict(peer_agree=(True, False)), "aiter quick all-reduce handle exchange failed: on another rank", "destroyed"),
    (dict(peer_ok=False), "aiter's quick all-reduce is unavailable on another rank", None),
    (dict(peer_host=12345), "the group spans nodes", None),
    (dict(quick_reduce=False), "this aiter has no quick all-reduce", None),
]


@pytest.mark.parametrize("version", [V017, V_MAIN])
@pytest.mark.parametrize("setup, what, fate", FAILURES)
def test_failed_set_up_declines_every_later_call_without_retry(qr_env, caplog, version, setup, what, fate):
    fake = qr_env(version, **setup)
    backend = AiterBackend()
    c = sized(64 * MIB)
    with caplog.at_level(logging.INFO, logger="arfusion"):
        first = backend.prepare_codec(c, "int4")
        calls_after_first = list(fake.calls)
        assert first.code is Why.RUNTIME, first
        assert backend.prepare_codec(c, "int4") == first
        assert backend.prepare_codec(sized(128 * MIB), "fp8") == first
    assert fake.calls == calls_after_first  # decided once: no second attempt, no collective
    comms = list(fake.qr_comms.values())
    if fate is None:
        assert comms == []
    else:
        assert len(comms) == 1 and comms[0]["destroyed"] == (fate == "destroyed")
        assert any("left allocated" in r.getMessage() for r in caplog.records) == (fate == "leaked")
    # The op falls back to the exact path; the close() after it destroys nothing more.
    backend.close()
    assert qr_names(fake).count("qr_destroy") == (1 if fate == "destroyed" else 0)


def test_no_set_up_during_graph_capture(qr_env, monkeypatch):
    fake = qr_env(V_MAIN)
    backend = AiterBackend()
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert backend.prepare_codec(sized(64 * MIB), "int4").code is Why.RUNTIME
    assert fake.calls == []
    monkeypatch.setattr(runtime, "capturing", lambda: False)
    assert backend.prepare_codec(sized(64 * MIB), "int4") is None
    monkeypatch.setattr(runtime, "capturing", lambda: True)  # once set up, captures may use it
    assert backend.prepare_codec(sized(64 * MIB), "int4") is None
    assert qr_names(fake).count("init_custom_qr") == 1


def test_set_up_runs_outside_graph_pools(qr_env, monkeypatch):
    qr_env(V_MAIN)
    seen = []
    monkeypatch.setattr(aiter_backend, "outside_graph_pools", lambda device, create: seen.append(device) or create())
    assert AiterBackend().prepare_codec(sized(64 * MIB), "int4") is None
    assert seen == [CUDA]


@pytest.mark.parametrize("version", [V017, V_MAIN])
def test_close_destroys_each_quick_reduce_once(qr_env, version):
    fake = qr_env(version)
    backend = AiterBackend()
    c = sized(64 * MIB)
    backend.prepare_codec(c, "int4")
    backend.prepare_codec(Call(**{**c.__dict__, "group_name": "tp1"}), "int4")
    ptrs = sorted(fake.qr_comms)
    backend.close()
    backend.close()
    destroyed = [args for name, args, _ in fake.calls if name == "qr_destroy"]
    assert sorted(d[0] for d in destroyed) == ptrs and all(len(d) == 1 for d in destroyed)
    assert all(comm["destroyed"] for comm in fake.qr_comms.values())
    assert fake.violations == []


# ---------------------------------------------------------------- the op's call


@pytest.mark.parametrize("version", [V017, V_MAIN])
@pytest.mark.parametrize("dtype, cast, level, code", [
    (BF16, None, "int4", 3), (BF16, "0", "fp8", 1), (BF16, "1", "int6", 2), (FP16, None, "fp8", 1)])
def test_op_calls_qr_all_reduce_in_aiters_argument_order(qr_env, monkeypatch, version, dtype, cast, level, code):
    fake = qr_env(version)
    if cast is not None:
        monkeypatch.setenv(limits.QUICK_REDUCE_CAST_ENV, cast)
    backend = AiterBackend()
    c = call(tokens=8, hidden=1024, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 1024, generator=g).to(dtype)
    residual = torch.randn(2, 4, 1024, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(1024, generator=g)).to(dtype)
    outs = arfusion.execution.codec_or_none(backend, c, x, residual, weight, 1e-6, None, level)
    name, args, kwargs = fake.calls[-1]
    assert name == "qr_all_reduce" and kwargs == {} and len(args) == 5
    ptr, inp, out, quant_level, cast_bf2half = args
    assert ptr == next(iter(fake.qr_comms))
    assert inp.shape == (8, 1024) and inp.is_contiguous() and torch.equal(inp, x.reshape(8, 1024))
    assert out.shape == inp.shape and out.dtype == dtype and out.data_ptr() != inp.data_ptr()
    assert type(quant_level) is int and quant_level == code
    assert cast_bf2half is (cast != "0")
    expected = reference.add_rms_norm(fake.reduce(x), residual, weight, 1e-6, c.form, None)
    assert [o.shape for o in outs] == [e.shape for e in expected]
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    assert fake.violations == []


def test_op_below_the_crossover_takes_the_exact_path_without_set_up(qr_env):
    fake = qr_env(V_MAIN)
    c = call(tokens=8, hidden=1024)
    path, _ = policy.route(AiterBackend(), c, policy.Caps(), "int4")
    assert path is not policy.Route.CODEC and fake.calls == []
    # With the threshold at 0 the same call takes the quantized all-reduce.
    assert policy.route(AiterBackend(), c, policy.Caps(codec_min=0), "int4") == (policy.Route.CODEC, None)


def test_op_after_a_failed_set_up_takes_the_exact_path(qr_env):
    fake = qr_env(V017, behaviour={"init_custom_qr": "raise"})
    backend = AiterBackend()
    c = call(tokens=8, hidden=1024)
    x = torch.randn(8, 1024).to(BF16)
    for _ in range(2):
        assert arfusion.execution.codec_or_none(backend, c, x, None, torch.ones(1024, dtype=BF16), 1e-6, None,
                                                "int4") is None
    assert qr_names(fake) == ["init_custom_qr"]


# ---------------------------------------------------------------- two real gloo ranks


def _two_ranks(rank):
    """Each scenario on 2 gloo ranks (real collectives), the fake aiter in each process."""
    out = {}
    scenarios = {
        "ok_017": (V017, {}), "ok_main": (V_MAIN, {}),
        "init_fails_on_rank1": (V017, {1: {"init_custom_qr": "raise"}}),
        "open_fails_on_rank0": (V_MAIN, {0: {"qr_open_handles": "raise"}}),
        "missing_on_rank1": (V_MAIN, {1: "no quick reduce"}),
    }
    group_name = dist.group.WORLD.group_name
    for name, (version, per_rank) in scenarios.items():
        mine = per_rank.get(rank, {})
        fake = FakeAiter(version=version, world_size=2, quick_reduce=mine != "no quick reduce",
                         behaviour={} if isinstance(mine, str) else mine)
        with pytest.MonkeyPatch.context() as mp:
            simulate_rocm(mp, "gfx942", fake)
            detection.detect.cache_clear()
            quick_reduce.quick_reduce_api.cache_clear()
            backend = AiterBackend()
            c = Call(**{**sized(8 * MIB, FP16).__dict__, "group_name": group_name})
            first = backend.prepare_codec(c, "int4")
            second = backend.prepare_codec(c, "int4")
            result = None
            if first is None:
                x = torch.full((c.tokens, c.hidden), rank + 1.0, dtype=FP16)
                result = backend.codec_all_reduce(c, x, "int4")[0, 0].item()
                backend.close()
            out[name] = {"first": first and first.code.value, "second": second and second.code.value,
                         "same": first == second, "calls": qr_names(fake), "result": result,
                         "destroyed": [v["destroyed"] for v in fake.qr_comms.values()],
                         "violations": fake.violations}
            detection.detect.cache_clear()
            quick_reduce.quick_reduce_api.cache_clear()
        # The fake's call log holds the process group, and the fake is in reference cycles (its
        # classes): collected now, or the group may outlive destroy_process_group and its gloo
        # threads abort the process at exit (seen about once in 25 runs before this).
        del fake, backend
        gc.collect()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return collect_from_ranks(_two_ranks, 2, tmp_path_factory.mktemp("quick_reduce"))


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_set_up_with_each_versions_exchange(two_ranks):
    for r in two_ranks:
        assert r["ok_017"]["first"] is None and r["ok_017"]["second"] is None
        assert r["ok_017"]["calls"] == ["init_custom_qr", "qr_get_handle", "qr_open_handles", "qr_all_reduce",
                                         "qr_destroy"]
        assert r["ok_main"]["calls"] == ["init_custom_qr", "qr_exchange_handles", "qr_get_handle",
                                         "qr_open_handles", "qr_all_reduce", "qr_destroy"]
        for name in ("ok_017", "ok_main"):
            assert r[name]["violations"] == [] and r[name]["destroyed"] == [True]
    # The fake computes world_size * x (it stands in for the sum, it does not compute it).
    assert [r["ok_main"]["result"] for r in two_ranks] == [2.0, 4.0]


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_fail_together_and_never_retry(two_ranks):
    for name in ("init_fails_on_rank1", "open_fails_on_rank0", "missing_on_rank1"):
        verdicts = [(r[name]["first"], r[name]["same"]) for r in two_ranks]
        assert verdicts == [("runtime", True)] * 2, (name, verdicts)  # both ranks decline, once
    r0, r1 = two_ranks
    assert r0["init_fails_on_rank1"]["calls"] == ["init_custom_qr", "qr_get_handle"]
    assert r1["init_fails_on_rank1"]["calls"] == ["init_custom_qr"]
    # Rank 0 failed opening: its communicator is left; rank 1's complete one is destroyed.
    assert r0["open_fails_on_rank0"]["destroyed"] == [False] and r1["open_fails_on_rank0"]["destroyed"] == [True]
    assert r0["missing_on_rank1"]["calls"] == []
