"""bench_fused_op.py's report: the tables printed at the end and the plot of bench_w*.json."""

from __future__ import annotations

import json

from common import pyplot, save_figure


def format_codec_table(rows):
    """Speedups are time ratios (>1: the second one named is faster): a0/q, ex/q, ex/b, fi_q/q."""
    lines = [f"{'MiB':>4} {'T':>5} {'a0 us':>8} {'c us':>8} {'b us':>8} {'q us':>8} {'fi_q us':>8} "
             f"{'a0/q':>6} {'ex/q':>6} {'ex/b':>6} {'fi_q/q':>6} {'q err':>8}  exact path; b ran; c ran"]
    for r in rows:
        def us(key):
            return f"{r[key]:8.1f}" if key in r else f"{'-':>8}"

        def ratio(key):
            return f"{r[key]:5.2f}x" if key in r else f"{'-':>6}"

        def ran(key):
            return ", ".join(f"{k} {v}" for k, v in r.get(f"{key}_dispatch", {}).items()) or r.get(f"{key}_error", "-")

        err = f"{r['q_err']:8.1e}" if "q_err" in r else f"{'-':>8}"
        lines.append(f"{r['mib']:>4g} {r['tokens']:>5} {us('a0_us')} {us('c_us')} {us('b_us')} {us('q_us')} "
                     f"{us('fi_q_us')} {ratio('q_vs_a0')} {ratio('q_vs_exact')} {ratio('b_vs_exact')} "
                     f"{ratio('fi_q_vs_q')} {err}  {r['exact_path']}; {ran('b')}; {ran('c')}")
    for r in rows:
        if "knobs_best_us" in r:
            knobs = ", ".join(f"{k}={v}" for k, v in r["knobs_best"].items())
            own = r.get("fi_q_us", float("nan"))
            lines.append(f"{r['mib']:>4g} MiB: FlashInfer's call {own:.1f} us with its own knobs, "
                         f"{r['knobs_best_us']:.1f} us at best of {len(r['knobs'])} ({knobs}); "
                         f"the exact path / that: {r.get('ex_vs_knobs_best', float('nan')):.3f}x")
    return "\n".join(lines)


def format_table(rows):
    head = (f"{'quant':>11} {'world':>5} {'hidden':>6} {'T':>5} {'MiB':>6} {'a us':>7} {'a0 us':>7} {'b us':>7} "
            f"{'c us':>7} {'u us':>7} {'a1 us':>7} {'d us':>7} {'ur us':>7} {'a0r us':>7} {'br us':>7} {'a/b':>6} {'a0/b':>6} {'a/c':>6} {'u/b':>6} {'1shot':>7} {'2shot':>7}  b path")
    lines = [head]
    for r in rows:
        def us(key):
            return f"{r[key]:7.1f}" if key in r else f"{'-':>7}"

        def ratio(num, den):
            return f"{r[num] / r[den]:5.2f}x" if num in r and den in r else f"{'-':>6}"

        lines.append(f"{r.get('quant', 'none'):>11} {r['world']:>5} {r['hidden']:>6} {r['tokens']:>5} {r['bytes_per_rank'] / 2**20:6.2f} "
                     f"{us('a_us')} {us('a0_us')} {us('b_us')} {us('c_us')} {us('u_us')} {us('a1_us')} {us('d_us')} "
                     f"{us('ur_us')} {us('a0r_us')} {us('br_us')} {ratio('a_us', 'b_us')} "
                     f"{ratio('a0_us', 'b_us')} {ratio('a_us', 'c_us')} {ratio('u_us', 'b_us')} {us('fi_1shot_us')} "
                     f"{us('fi_2shot_us')}  "
                     f"{r['b_path']}")
    return "\n".join(lines)


def plot(paths, png):
    plt = pyplot()
    data = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(len(data), 2, figsize=(13, 4.2 * len(data)), squeeze=False)
    for (ax_us, ax_x), d in zip(axes, data):
        world = d["meta"]["world"]
        for hidden, style in ((4096, "-"), (8192, "--")):
            rows = [r for r in d["rows"] if r["hidden"] == hidden]
            if not rows:
                continue
            for key, label, color in (("a_us", "(a) NCCL + compiled norm", "tab:gray"),
                                      ("a0_us", "(a0) same, in place", "tab:brown"),
                                      ("b_us", "(b) arfusion as dispatched", "tab:blue"),
                                      ("c_us", "(c) FlashInfer forced", "tab:orange")):
                pts = [(r["tokens"], r[key]) for r in rows if key in r]
                ax_us.plot(*zip(*pts), style, marker=".", color=color, label=f"{label}, H={hidden}")
            for key, label, color in (("b_us", "(b) arfusion", "tab:blue"), ("c_us", "(c) FlashInfer forced", "tab:orange")):
                pts = [(r["tokens"], r["a_us"] / r[key]) for r in rows if key in r]
                ax_x.plot(*zip(*pts), style, marker=".", color=color, label=f"{label}, H={hidden}")
        ax_us.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per call (CUDA graph)",
                  title=f"{d['meta']['device']}, TP={world}, bf16")
        ax_x.axhline(1.0, color="black", lw=0.8)
        ax_x.axhline(0.97, color="red", lw=0.8, ls=":")
        ax_x.set(xscale="log", xlabel="tokens", ylabel="speedup vs (a)", title=f"TP={world}: (a) / variant")
        ax_us.legend(fontsize=6)
        ax_x.legend(fontsize=6)
    save_figure(fig, png)

