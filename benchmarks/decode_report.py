"""bench_hf_decode.py's report: the end-of-run table and the plot of decode_*.json files."""

from __future__ import annotations

import json

from common import pyplot, save_figure
from decode_host import host_summary
from decode_model import CONFIGS


def format_table(result: dict) -> str:
    m, ph = result["meta"], result["phases"]
    fake = " (fake process group: no communication)" if m.get("fake_world") else ""
    lines = [f"{m['model_type']} {m['layers']} layers, hidden {m['hidden']}, TP={m['world']}{fake}, {m['device']}, "
             f"torch {m['torch']}, transformers {m['transformers']}"]
    if "rows" in ph.get("decode", {}):
        floor = "floor_ms" in ph["decode"]["rows"][0]
        lines.append(f"{'decode step':<22} {'off ms':>9} {'on ms':>9} {'gain':>7} {'on tok/s':>10}"
                     + (f" {'floor ms':>9} {'comm removed':>13}" if floor else ""))
        for r in ph["decode"]["rows"]:
            lines.append(f"{'batch ' + str(r['batch']):<22} {r['off_ms']:9.3f} {r['on_ms']:9.3f} "
                         f"{r['gain_pct']:6.1f}% {r['on_tokens_per_s']:10.1f}"
                         + (f" {r['floor_ms']:9.3f} {str(r['comm_removed_pct']) + '%' if r['comm_ms'] > 0 else '-':>13}"
                            if floor else ""))
    if "rows" in ph.get("prefill", {}):
        level = ph["prefill"].get("quantized")
        if level:
            lines.append(f"{'prefill':<22} {'off ms':>9} {'on ms':>9} {'gain':>7} {'on tok/s':>10} {level + ' ms':>9} "
                         f"{'vs off':>7} {'vs on':>7} {'quantized calls':>16}")
        for r in ph["prefill"]["rows"]:
            line = (f"{'prefill ' + str(r['tokens']):<22} {r['off_ms']:9.3f} {r['on_ms']:9.3f} "
                    f"{100 * (1 - r['on_vs_off']):6.1f}% {r['on_tokens_per_s']:10.1f}")
            if "quantized_ms" in r:
                line += (f" {r['quantized_ms']:9.3f} {r['quantized_speedup']:6.3f}x {r['quantized_vs_on']:6.3f}x "
                         f"{str(r['quantized_calls']) + '/' + str(r['op_calls']):>16}")
            lines.append(line)
    if "summary" in ph.get("accuracy", {}):
        s = ph["accuracy"]["summary"]
        lines.append(f"accuracy ({ph['accuracy']['steps']} steps): on vs off max rel L2 {s['on_vs_off_max_rel_l2']:.2e}, "
                     f"top-1 {100 * s['on_vs_off_top1']:.1f}%; off vs eager {s['off_vs_eager_max_rel_l2']:.2e} / "
                     f"{100 * s['off_vs_eager_top1']:.1f}%")
        if "on_vs_fp32_max_rel_l2" in s:
            lines.append("  vs the same weights in fp32 (max rel L2 / top-1): " + ", ".join(
                f"{n} {s[f'{n}_vs_fp32_max_rel_l2']:.2e} / {100 * s[f'{n}_vs_fp32_top1']:.1f}%"
                for n in ("eager", *CONFIGS)))
    if "cold_off" in ph.get("startup", {}):
        s = ph["startup"]
        lines.append(f"startup to first token: cold off {s['cold_off']['seconds']} s, on {s['cold_on']['seconds']} s "
                     f"(pass itself {s['cold_on']['pass_seconds']} s, {s['cold_on']['fused_sites']} sites); warm off "
                     f"{s['warm_off']['seconds']} s, on {s['warm_on']['seconds']} s")
    if "off" in ph.get("kernels", {}):
        k = ph["kernels"]
        lines.append(f"kernels per step: off {k['off']['total']['kernels']}, on {k['on']['total']['kernels']} "
                     f"({k['kernels_saved_per_layer']} fewer per layer)")
    lines.extend(host_summary(result))
    for name, p in ph.items():
        if "error" in p or "skipped" in p:
            lines.append(f"{name}: {p.get('error') or p.get('skipped')}")
    return "\n".join(lines)



def pair_rows(d: dict) -> list[tuple[str, list[float], float]]:
    """(label, each valid pair's on/off speed, their median) for every loop or generate variant of
    one decode_*.json: what a host-bound comparison's noise looks like, pair by pair."""
    m = d["meta"]
    where = ("NCCL on one rank" if m.get("all_reduces_on_one_rank") else "fake group") if m.get("fake_world") else "real"
    rows = []
    for kind in ("loop", "generate"):
        for variant, row in d["phases"].get(kind, {}).get("variants", {}).items():
            ratios = [p["on_speedup"] for p in row.get("pairs", []) if p.get("valid") and "on_speedup" in p]
            if ratios:
                rows.append((f"{m['model_type']} {m['layers']}L {kind} {variant}, off's all-reduce: {where}",
                             ratios, row["on_speedup"]["median"]))
    return rows


def plot_pairs(data: list, png: str) -> None:
    """Each variant's pairs as dots on one line, its median as a bar; 1.0 and 0.98 marked."""
    plt = pyplot()
    rows = [r for d in data for r in pair_rows(d)]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.6))
    for y, (label, ratios, median) in enumerate(rows):
        ax.scatter(ratios, [y] * len(ratios), s=14, alpha=0.6, color="tab:blue")
        ax.plot([median, median], [y - 0.3, y + 0.3], color="black", lw=2)
        ax.annotate(f"{median:.2f}x ({len(ratios)} pairs)", (median, y + 0.32), fontsize=7, ha="center")
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.axvline(0.98, color="red", lw=0.8, ls=":", label="0.98x, the never-slower bar")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()  # the files' order, top down
    m = data[0]["meta"]
    ax.set(xlabel="on / off speed in one interleaved pair (> 1: faster with the pass)",
           title=f"{m['device']}, {m['date'][:10]}: each pair's ratio, medians as bars")
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, png)


def plot(paths, png):
    plt = pyplot()
    loaded = [json.load(open(p)) for p in paths]
    data = [d for d in loaded if "rows" in d["phases"].get("decode", {})]
    if not data and any(pair_rows(d) for d in loaded):  # loop / generate runs: their pairs
        return plot_pairs([d for d in loaded if pair_rows(d)], png)
    if not data:
        raise SystemExit("no decode rows or pairs in " + ", ".join(paths))
    fig, (ax_step, ax_acc) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / (2 * len(data))
    for i, d in enumerate(data):
        rows, world = d["phases"]["decode"]["rows"], d["meta"]["world"]
        xs = range(len(rows))
        for j, (name, color) in enumerate((("off", "tab:gray"), ("on", "tab:blue"))):
            offset = (2 * i + j - len(data) + 0.5) * width
            bars = ax_step.bar([x + offset for x in xs], [r[f"{name}_ms"] for r in rows], width,
                               color=color, alpha=0.5 + 0.5 * i / max(1, len(data) - 1),
                               label=f"TP={world} {'arfusion' if name == 'on' else 'torch.compile'}")
            if name == "on":
                ax_step.bar_label(bars, [f"{r['gain_pct']:+.0f}%" for r in rows], fontsize=7)
        ax_step.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
        acc = d["phases"].get("accuracy", {})
        if "on_vs_off_rel_l2" in acc:
            ax_acc.plot(acc["on_vs_off_rel_l2"], marker=".", label=f"TP={world} arfusion vs torch.compile")
            ax_acc.plot(acc["off_vs_eager_rel_l2"], ls=":", label=f"TP={world} torch.compile vs eager")
        for name, label in (("on", "arfusion"), ("off", "torch.compile")):
            if f"{name}_vs_fp32_rel_l2" in acc:
                ax_acc.plot(acc[f"{name}_vs_fp32_rel_l2"], ls="--", label=f"TP={world} {label} vs fp32")
    m = data[0]["meta"]
    ax_step.set(ylabel="ms per decode step (one CUDA graph)",
                title=f"{m['model_type']} {m['layers']}L h{m['hidden']}, {m['device']}: decode step")
    ax_step.legend(fontsize=7)
    ax_acc.axhline(2e-2, color="red", lw=0.8, ls=":", label="accuracy bar 2e-2")
    ax_acc.set(yscale="log", xlabel="teacher-forced step", ylabel="logits relative L2", title="accuracy")
    ax_acc.legend(fontsize=7)
    save_figure(fig, png)

