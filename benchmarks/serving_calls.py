"""Which timed calls of the serving benchmark (benchmarks/bench_serving.py) count, what each measured,
and how two configs' calls pair: metrics from transformers' per-token timestamps, calls that captured
a CUDA graph or compiled kept apart, calls of two configs alternated in rounds, arfusion's counters
summed over calls, and new prompts for every call."""

from __future__ import annotations

import collections
import statistics

import torch

from serving_probes import graph_work


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def call_window(outputs: dict) -> tuple[float, float]:
    """(first admission, last token) of one generate_batch call, over its requests with tokens."""
    stamped = [o for o in outputs.values() if o.timestamps]
    return min(o.created_time for o in stamped), max(o.timestamps[-1] for o in stamped)


def serving_metrics(outputs: dict) -> dict:
    """TTFT, ITL and throughput of one generate_batch call, from its per-token timestamps, and each
    distinct first-token time from the first admission (`first_tokens_ms`)."""
    ttft, gaps, tokens = [], [], 0
    admitted, last = call_window(outputs)
    firsts = set()
    for out in outputs.values():
        stamps = out.timestamps or []
        if not stamps:
            continue
        ttft.append(stamps[0] - out.created_time)
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        tokens += len(out.generated_tokens)
        firsts.add(round(1e3 * (stamps[0] - admitted), 1))
    return {"ttft_ms": 1e3 * statistics.median(ttft), "itl_ms": 1e3 * statistics.median(gaps),
            "itl_p90_ms": 1e3 * percentile(gaps, 0.9), "tokens_per_s": tokens / (last - admitted),
            "new_tokens": tokens, "first_tokens_ms": sorted(firsts)}


def measured(call, any_rank=bool) -> tuple[dict, bool]:
    """(`call()`'s metrics with its graph work, whether to exclude it): a call that captured a CUDA
    graph or compiled is excluded; with TP, where it did so on `any_rank` (a function of this rank's
    verdict), so that every rank keeps the same calls and makes as many (a rank making one call more
    than its peers would wait for them for ever)."""
    with graph_work() as work:
        metrics = call()
    return {**metrics, **work}, any_rank(bool(work["captured"] or work["compiled"]))


def steady_calls(call, repeats: int, any_rank=bool) -> tuple[list[dict], list[dict]]:
    """(steady calls, excluded calls): `call()` until `repeats` calls were not excluded (`measured`),
    or 2 x repeats were made (`interleaved_calls` of one config: each call's `round` is its index);
    each call's metrics carry its graph work."""
    return interleaved_calls({"": call}, repeats, any_rank)[""]


def interleaved_calls(calls: dict, repeats: int, any_rank=bool) -> dict:
    """{config: (steady calls, excluded calls)}: rounds of one call of each config in `calls`,
    in turn (A B, then B A, ...), until each config has `repeats` steady calls or 2 x repeats
    rounds were made. Each call carries its `round`; a slow stretch of the host hits neighbours."""
    kept = {name: ([], []) for name in calls}
    names = list(calls)
    for made in range(2 * repeats):
        if all(len(steady) >= repeats for steady, _ in kept.values()):
            break
        for name in names if made % 2 == 0 else names[::-1]:
            metrics, drop = measured(calls[name], any_rank)
            kept[name][drop].append({**metrics, "round": made})
    return kept


def pair_ratios(on: list[dict], off: list[dict], key: str) -> list[float]:
    """on / off of `key` for each round both configs' calls were steady in (interleaved calls)."""
    offs = {c["round"]: c[key] for c in off if "round" in c}
    return [round(c[key] / offs[c["round"]], 4) for c in on if c.get("round") in offs]


DICT_STATS = ("dispatch", "dispatch_in_cuda_graphs", "eager_in_cuda_graphs", "split_by_graph_breaks")
STATS_KEPT = ("fused_sites", "graphs") + DICT_STATS


def add_stats(total: dict, more: dict) -> dict:
    """`arfusion.stats()` counters summed: numbers add, dicts of counts add key by key."""
    out = dict(total)
    for key, value in more.items():
        if isinstance(value, dict):
            out[key] = dict(collections.Counter(out.get(key, {})) + collections.Counter(value))
        elif isinstance(value, (int, float)):
            out[key] = out.get(key, 0) + value
    return out


def prompts_for(requests: int, length: int, vocab: int, call: int = 0) -> list[list[int]]:
    """`requests` random prompts, new for each `call` (the same in every config): transformers shares
    KV blocks between requests with a common prefix, so a call repeating an earlier call's prompts
    would find much of their prefill done (seen: 16,479 of 32,768 prompt tokens prefilled)."""
    g = torch.Generator().manual_seed(1000 * requests + call)
    return torch.randint(3, vocab, (requests, length), generator=g).tolist()
