"""The speed matrix: the ways users run a model, without and with the pass, side by side on one machine.

    python benchmarks/matrix.py plan                          # the stages: GPUs, time limit, command
    python benchmarks/matrix.py run decode2 decode4 generate2@0,1+prefill2@2,3 --out $OUT/m --deadline 560
    python benchmarks/matrix.py run "serve2@0,1:--configs=off+serve2@2,3:--configs=on" --out $OUT/m --deadline 550
    python benchmarks/matrix.py report $OUT/m ... --out docs/data/matrix   # JSON + PNG + table per machine

`run` takes groups in order; the stages of one group (joined by "+") run at the same time, each on the GPUs
after "@" (default: the first ones), so two 2-GPU stages share a 4-GPU host; stages joined by ">" run one
after another in their lane (quantized2@2,3>moe2@2,3 beside site2@0,1). A stage may set variables after ":"
(generate2@2,3:TRANSFORMERS_WHEEL=.whl/transformers-5.24.0-py3-none-any.whl runs it with that transformers,
installed apart; TRANSFORMERS_DEPS=.whl/hub adds that folder's wheels; a .tar.xz that
benchmarks/device/stage_transformers.py made, transformers 5.25 with its huggingface_hub 2.4, is unpacked).
Each stage runs under its own limit, cut to what is left of --deadline, and writes its JSON and log under
--out/STAGE (the folder's name adds the stage's variables and arguments). Off and on run in one
process (serving: in two stages at once on two GPU pairs, or back to back on the same warm host), so every
ratio comes from one machine. A decode stage needs the host alone: its six compiles (off, on, floor; batch 1
and the dynamic batch) beside another stage's did not finish in 465 s on 4×H100 (2026-11-27), and beside the
site stages its batch-1 floor came out 8% shorter than alone on another H200 host (2026-11-28). A serve stage
runs one config at a time (:--configs=off, :--configs=on), and `report` joins the two files.

`report` reads every result JSON under the folders given (bench_fused_op.py's bench_*_w*.json,
bench_hf_decode.py's decode_*.json, bench_serving.py's serving_*.json), groups them by machine
(device and date, or --name) and writes, per machine, matrix_<machine>.json (one row per
measurement: path, model, TP, case, off, on, the floor where measured, on/off speed with its spread,
versions, source file), matrix_<machine>.md (the table) and matrix_<machine>.png (speed per row
against the 0.98 bar).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import pyplot, save_json  # noqa: E402
from matrix_stages import STAGES, plan  # noqa: E402

BAR = 0.98  # "never slower": on/off speed at or above this, beyond its spread
PLOT_MIN, PLOT_MAX = 0.7, 1.6  # the plot's speed axis, widened where a median lies outside


def parse_spec(spec: str) -> tuple[str, list[int] | None, dict, list[str]]:
    """'generate2@2,3:A=1:B=2' -> ('generate2', [2, 3], {'A': '1', 'B': '2'}, []). A key that starts
    with "--" is one more argument (or flag) for the stage's script, after its own (so it wins):
    'serve2@0,1:--configs=off' -> (..., {}, ['--configs', 'off']); 'decode2:--batches=8 32' -> [..., '8', '32'];
    'serve2:--profile-kernels' -> [..., '--profile-kernels']."""
    head, *sets = spec.split(":")
    name, _, gpus = head.partition("@")
    if name not in STAGES:
        raise SystemExit(f"unknown stage {name!r}; `matrix.py plan` lists them")
    devices = [int(g) for g in gpus.split(",")] if gpus else None
    if devices is not None and len(devices) != STAGES[name].gpus:
        raise SystemExit(f"{name} takes {STAGES[name].gpus} GPUs, not {gpus}")
    bad = [e for e in sets if "=" not in e and not e.startswith("--")]
    if bad:  # e.g. "--gen-variants=greedy:1" cut at its ":"
        raise SystemExit(f"{spec!r}: {bad[0]!r} is not VAR=VALUE, --ARG=VALUE or --FLAG (':' splits; greedy_b1)")
    pairs = [e.split("=", 1) if "=" in e else (e, "") for e in sets]
    args = [word for k, v in pairs if k.startswith("--") for word in (k, *v.split())]
    return name, devices, {k: v for k, v in pairs if not k.startswith("--")}, args


def carried_name(path: str) -> str:
    """A carried transformers by its file name: 'transformers-5.25.0' for .whl/transformers-5.25.0.tar.xz."""
    name = Path(path).name
    return name.removesuffix(".tar.xz") if name.endswith(".tar.xz") else Path(name).stem


def stage_folder(name: str, args: list[str], env: dict | None = None) -> str:
    """The stage's results folder: its name, its variables (a wheel by its file name) and its extra
    arguments, so that two runs of one stage (serve2 off and on at once, moe2 with and without the
    MoE finalize kernel) write apart."""
    sets = [f"{k}{carried_name(v) if k == 'TRANSFORMERS_WHEEL' else v}" for k, v in (env or {}).items()]
    return "_".join([name] + [re.sub(r"[^A-Za-z0-9.]+", "", a) for a in sets + args])


def stage_command(name: str, out: Path, slot: int, limit_s: float, args: list[str] = ()) -> list[str]:
    """torchrun of the stage's script (plain python for a --fake-world stage); `slot`: its place in
    its group (its own port and random checkpoint folder: stages at the same time never write one
    checkpoint together, stages one after another reuse it)."""
    s = STAGES[name]
    extra = [] if s.script == "bench_fused_op.py" else ["--ckpt-dir", f"/tmp/arfusion-matrix-ckpt{slot}"]
    if s.script == "bench_hf_decode.py":  # no phase or variant starts after this: the stage ends with its results
        extra += ["--budget-s", str(int(limit_s - 90))]
    launch = ([sys.executable] if "--fake-world" in s.args.split() else  # one process standing for a TP rank
              [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(s.gpus), "--master-port",
               str(29500 + 11 * slot)])
    return [*launch, str(HERE / s.script), *s.args.split(), *extra, *args, "--out", str(out)]


def stage_env(devices: list[int] | None, extra: dict) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    wheel = extra.pop("TRANSFORMERS_WHEEL", None)
    if wheel:  # that transformers, installed apart, ahead of the machine's
        target = Path("/tmp") / f"transformers-{carried_name(wheel)}"
        # transformers >= 5.25 needs a huggingface_hub newer than the machines': TRANSFORMERS_DEPS
        # names a folder of wheels (it and its own) that go in with it; stage_transformers.py's
        # tarball holds them already.
        folder = extra.pop("TRANSFORMERS_DEPS", None)
        deps = sorted(str(p) for p in Path(folder).glob("*.whl")) if folder else []
        if not target.exists():
            if wheel.endswith(".tar.xz"):
                target.mkdir(parents=True)
                subprocess.run(["tar", "xJf", wheel, "-C", str(target)], check=True)
            else:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                                "--target", str(target), wheel, *deps], check=True)
        env["PYTHONPATH"] = f"{target}:{env.get('PYTHONPATH', '')}"
        env.setdefault("USE_HUB_KERNELS", "0")  # 5.25 loads hub kernels on CUDA by default: no network there
    env.update(extra)
    return env


def run_stage(spec: tuple, slot: int, out: Path, end: float) -> int:
    """One stage under its limit, cut to what is left before `end`; 1 where it failed or was skipped."""
    name, devices, extra, args = spec
    left = end - time.time()
    limit = min(STAGES[name].limit_s, left - 5)
    if limit < 60:
        print(f"=== {name} skipped: {left:.0f} s left before the deadline", flush=True)
        return 1
    folder = out / stage_folder(name, args, extra)
    folder.mkdir(parents=True, exist_ok=True)
    env = stage_env(devices, dict(extra))
    cmd = ["timeout", "-k", "10", str(int(limit))] + stage_command(name, folder, slot, limit, args)
    print(f"=== {name} on GPUs {devices or 'first'} (limit {limit:.0f} s) {extra or ''}: {' '.join(cmd[4:])}",
          flush=True)
    t0 = time.time()
    with open(folder / "log.txt", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    tail = (folder / "log.txt").read_text(errors="replace").splitlines()[-25:]
    print(f"=== {folder.name} rc={rc} after {time.time() - t0:.0f} s\n" + "\n".join(tail), flush=True)
    return int(rc != 0)


def parse_group(group: str) -> list[list[tuple]]:
    """'a@0,1+b@2,3>c@2,3' -> lanes [[a], [b, c]]: the lanes run at the same time, the stages of a
    lane one after another (on the same GPUs: a short stage and a longer one fill a GPU pair)."""
    return [[parse_spec(s) for s in lane.split(">")] for lane in group.split("+")]


def run(groups: list[str], out: Path, deadline_s: float) -> int:
    end = time.time() + deadline_s
    plans = [parse_group(g) for g in groups]  # every spec checked before anything starts
    failed = 0
    for lanes in plans:
        counts = [0] * len(lanes)

        def lane_run(i: int, lane: list[tuple]) -> None:
            counts[i] = sum(run_stage(spec, i, out, end) for spec in lane)

        threads = [threading.Thread(target=lane_run, args=(i, lane)) for i, lane in enumerate(lanes)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        failed += sum(counts)
    return failed


# ----------------------------------------------------------------- report


def machine_key(meta: dict, date: str) -> str:
    device = re.sub(r"[^a-z0-9]+", "", (meta.get("device") or "cpu").lower().replace("nvidia", ""))
    return f"{device}_{date}"


def speed(off: float, on: float, higher_is_better: bool = False) -> float:
    return round(on / off if higher_is_better else off / on, 4)


def rows_from(path: Path, data: dict | None = None) -> list[dict]:
    data = data if data is not None else json.loads(path.read_text())
    meta = data.get("meta", {})
    versions = {k: meta.get(k) for k in ("torch", "transformers", "flashinfer") if meta.get(k)}
    common = {"device": meta.get("device"), "date": (meta.get("date") or time.strftime("%Y-%m-%d", time.localtime(
        path.stat().st_mtime)))[:10], "versions": versions, "source": path.name}
    out = []
    if path.name.startswith("bench_quantized_") and "rows" in data:  # --quantized: the codec at prefill sizes
        for r in data["rows"]:
            unfused = not r.get("b_dispatch")  # the pass left the site to Inductor: its graph copies the input
            out.append({**common, "path": "site, quantized all-reduce", "model": f"hidden {r['hidden']}",
                        "tp": r["world"], "case": f"{r['mib']:g} MiB per rank", "unit": "us per call",
                        "off": round(r["a0_us"], 2), "on": round(r["b_us"], 2), "speed": speed(r["a0_us"], r["b_us"]),
                        "note": f"{meta.get('level', '')}; vs the exact fused path {r['b_vs_exact']:.3f}" + (
                            "; left unfused (the graph without the pass, its input copied; off reduces in place)"
                            if unfused else ""), "vs_exact": r["b_vs_exact"], **({"left_unfused": True} if unfused else {})})
    elif path.name.startswith("bench_") and "rows" in data:  # bench_fused_op.py: us per call
        quant = "quant" in path.name
        for r in data["rows"]:
            if "b_us" not in r:
                continue
            # off: NCCL in place + the compiled norm (what an unfused model runs; Inductor alone is slower);
            # where the site is left unfused, Inductor's graph without and with the pass ("ur", "br").
            # where a quant site is left unfused (no "br"), the harness's own unfused graph ("a": NCCL on a copy).
            unfused = r.get("b_path") == "unfused"
            off, on = ("ur_us", "br_us") if "br_us" in r else ("a_us", "b_us") if unfused else ("a0_us", "b_us")
            out.append({**common, "path": "site", "model": f"hidden {r['hidden']}", "tp": r["world"],
                        "case": f"T={r['tokens']}" + (f" {r.get('quant')}" if quant else ""), "unit": "us per call",
                        "off": round(r[off], 2), "on": round(r[on], 2), "speed": speed(r[off], r[on]),
                        "note": r.get("b_path", "") + {"ur_us": " (off: Inductor alone)",
                                                       "a_us": " (off: NCCL on a copy + the compiled norm)"}.get(off, "")})
    elif path.name.startswith("decode_"):
        model = (f"{meta['model_type']} {meta['layers']}L h{meta['hidden']}"
                 + (f" ({meta['unique_layers']} unique)" if meta.get("unique_layers") else "")
                 + (", MoE finalize" if meta.get("moe_finalize") else ""))
        tp, phases = meta["world"], data["phases"]
        cut = [c] if {"off_ms", "on_ms"} <= set(c := phases.get("decode", {}).get("incomplete_row", {})) else []
        for r in phases.get("decode", {}).get("rows", []) + cut:  # cut: a batch killed before its floor was timed
            row = {**common, "path": "decode step (CUDA graph)", "model": model, "tp": tp, "case": f"batch {r['batch']}",
                   "unit": "ms per step", "off": r["off_ms"], "on": r["on_ms"], "speed": speed(r["off_ms"], r["on_ms"])}
            if "floor_ms" in r:
                row.update(floor=r["floor_ms"], comm_removed_pct=r["comm_removed_pct"])
            out.append(row)
        for r in phases.get("prefill", {}).get("rows", []):
            out.append({**common, "path": "prefill", "model": model, "tp": tp, "case": f"{r['tokens']} tokens",
                        "unit": "ms", "off": r["off_ms"], "on": r["on_ms"], "speed": speed(r["off_ms"], r["on_ms"])})
            if "quantized_ms" in r:
                out.append({**common, "path": "prefill, quantized all-reduce", "model": model, "tp": tp,
                            "case": f"{r['tokens']} tokens", "unit": "ms", "off": r["off_ms"], "on": r["quantized_ms"],
                            "speed": speed(r["off_ms"], r["quantized_ms"])})
        for kind in ("generate", "loop"):
            for label, v in phases.get(kind, {}).get("variants", {}).items():
                if "error" in v or not v.get("on_speedup"):
                    continue
                s, no_graphs = v["on_speedup"], phases[kind].get("mode") == "default" and meta["device"] != "cpu"
                out.append({**common, "path": "HF generate()" if kind == "generate" else "reduce-overhead loop",
                            "model": model, "tp": tp, "unit": "ms per token",
                            "case": label.replace("_b", ", batch ") + (", default mode (no CUDA graphs)" * no_graphs),
                            "off": v["off"]["ms_per_token"], "on": v["on"]["ms_per_token"], "speed": s["median"],
                            "spread": [s["min"], s["max"]], "pairs": s["n"], "excluded_pairs": v["excluded_pairs"],
                            "gpu_busy_fraction": [v[c].get("gpu_busy_fraction") for c in ("off", "on")]})
    elif path.name.startswith("serving_"):
        model = f"{meta['model_type']} {meta['layers']}L h{meta['hidden']}"
        for requests, r in data.get("mixes", {}).items():
            if "off" not in r or "on" not in r:
                continue
            started = f"; calls started together, idle wait {meta['idle_wait_ms']:g} ms" if meta.get("idle_wait_ms") else ""
            interleaved = meta.get("interleave") or "--interleave" in meta.get("command", "").split()
            note = ("off and on at once on two GPU pairs of the host" if meta.get("merged_from")
                    else "in one process, calls interleaved (off on, on off, ...)" if interleaved
                    else f"in one process, {next(iter(data.get('configs') or {'off': 0}))} first") + started
            excluded = sum(len(r[c].get("excluded_calls", [])) for c in ("off", "on"))
            if excluded:  # timed calls that captured CUDA graphs or compiled (bench_serving.steady_calls)
                note = "; ".join(filter(None, [note, f"{excluded} calls excluded (graphs captured or compiled)"]))
            for key, unit, higher in (("tokens_per_s", "tokens/s", True), ("itl_ms", "ms inter-token", False),
                                      ("ttft_ms", "ms to first token", False)):
                row = {**common, "path": "generate_batch", "model": model, "tp": meta["world"],
                       "case": f"{requests} requests, {unit}" + (f", KV padded to {meta['kv_padding']}" if meta.get(
                           "kv_padding") else "") + (f", {meta['attn']}" if meta.get("attn", "sdpa") != "sdpa" else ""),
                       "unit": unit, "off": round(r["off"][key], 3),
                       "on": round(r["on"][key], 3), "speed": speed(r["off"][key], r["on"][key], higher), "note": note}
                if interleaved:  # on / off of each round whose two calls were steady (bench_serving's `pairs`)
                    ratios = [round(v if higher else 1 / v, 4) for v in r.get("pairs", {}).get(key, [])]
                else:  # the i-th timed calls of off and on (at the same time where run apart)
                    ratios = [speed(a[key], b[key], higher)
                              for a, b in zip(r["off"].get("calls", []), r["on"].get("calls", []))]
                if len(ratios) > 1:
                    row.update(spread=[min(ratios), max(ratios)], pairs=len(ratios))
                    if interleaved:  # the row's speed is the rounds' median, as for generate()
                        row["speed"] = round(statistics.median(ratios), 4)
                out.append(row)
    for row in out:
        row["machine"] = machine_key(meta, common["date"])
        if meta.get("fake_world") or meta.get("shared_gpu"):  # collectives that compute nothing, or ranks taking turns
            row["stand_in"] = True  # a check of a path, not a user's speed: no goal reads it
            row["path"] += ((" (fake world, NCCL's host path)" if meta.get("all_reduces_on_one_rank") else " (fake world)")
                            if meta.get("fake_world") else " (two ranks on one GPU)")
    return out


def below(row: dict) -> str:
    """The flag of a row whose median is under the bar; "within its spread" where a paired call
    reached the bar (the median alone does not show it slower)."""
    if row["speed"] >= BAR:
        return ""
    if row.get("left_unfused"):
        return " **below 0.98** (left unfused: the graph without the pass)"
    return " **below 0.98**" + (" (within its spread)" if row.get("spread", (0, 0))[1] >= BAR else "")


def table(rows: list[dict]) -> str:
    lines = ["| path | model | TP | case | transformers | unit | off | on | floor | on/off speed | spread | note |",
             "|---|---|---:|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        spread = f"{r['spread'][0]:.3f}–{r['spread'][1]:.3f} ({r['pairs']} pairs)" if "spread" in r else ""
        note = r.get("note", "")
        if any(f is not None for f in r.get("gpu_busy_fraction") or ()):  # None: no kernel profile in that run
            # A fraction outside 0..1 is a profile spoiled by rank skew (a collective waiting for its peer).
            note = "GPU busy " + " / ".join(f"{100 * f:.0f}%" if f is not None and 0 <= f <= 1 else "?"
                                            for f in r["gpu_busy_fraction"]) + " (off / on)"
        note += f"{'; ' if note else ''}{r['excluded_pairs']} excluded (graphs recorded again)" if r.get("excluded_pairs") else ""
        if r.get("comm_removed_pct") is not None:
            note = f"removes {r['comm_removed_pct']:.0f}% of the all-reduces' time"
        flag = below(r)
        lines.append(f"| {r['path']} | {r['model']} | {r['tp']} | {r['case']} | {r['versions'].get('transformers', '')} "
                     f"| {r['unit']} | {r['off']:.4g} | {r['on']:.4g} "
                     f"| {format(r['floor'], '.4g') if 'floor' in r else ''} | {r['speed']:.3f}×{flag} | {spread} | {note} |")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 0.3 * len(rows) + 1.8))
    ys = list(range(len(rows)))[::-1]
    colors = {"site": "tab:blue", "decode step (CUDA graph)": "tab:green", "prefill": "tab:olive",
              "prefill, quantized all-reduce": "tab:brown", "site, quantized all-reduce": "tab:cyan", "HF generate()": "tab:purple",
              "reduce-overhead loop": "tab:pink", "generate_batch": "tab:orange"}
    for y, r in zip(ys, rows):
        lo, hi = r.get("spread", (r["speed"], r["speed"]))
        ax.barh(y, r["speed"] - 1, left=1, color=colors.get(r["path"], "tab:gray"), alpha=0.8)
        if "spread" in r:  # a ratio of medians may fall outside its paired calls' range
            ax.errorbar(r["speed"], y, xerr=[[max(0.0, r["speed"] - lo)], [max(0.0, hi - r["speed"])]], color="black",
                        capsize=2, lw=0.8)
    # Every row's median in view; a spread reaching past [PLOT_MIN, PLOT_MAX] is cut at the frame.
    ax.set_xlim(min(PLOT_MIN, *(r["speed"] - 0.05 for r in rows)), max(PLOT_MAX, *(r["speed"] + 0.05 for r in rows)))
    for y, r in zip(ys, rows):
        ax.annotate(f"{r['speed']:.3f}×", (r["speed"], y), xytext=(3, 3), textcoords="offset points", fontsize=6)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(BAR, color="red", lw=0.8, ls=":", label="0.98: never slower")
    ax.set_yticks(ys, [f"{r['path']}, TP={r['tp']}, {r['model']}, {r['case']}"
                       + (f", tf {r['versions']['transformers']}" if "transformers" in r["versions"] else "")
                       for r in rows], fontsize=7)
    ax.set(xlabel="on / off speed (> 1: faster with arfusion)", title=title)
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(str(png), dpi=110, bbox_inches="tight")  # the long row labels kept whole


def merge_serving(paths: list[Path]) -> dict[Path, dict]:
    """Serving results by file; an "off"-only and an "on"-only run of one setup (one machine, model,
    world, prompt and output lengths: serve2 off and on on two GPU pairs at once) become one."""
    merged, by_setup = {}, {}
    for path in paths:
        data = json.loads(path.read_text())
        meta = data["meta"]
        key = tuple(meta.get(k) for k in ("device", "model_type", "layers", "hidden", "world", "fake_world",
                                          "prompt", "new", "cuda_graphs", "kv_padding", "attn", "idle_wait_ms"))
        other = next((p for p in by_setup.get(key, []) if not set(data["configs"]) & set(merged[p]["configs"])), None)
        if other is not None:
            into = merged[other]
            into["meta"]["merged_from"] = [other.name, path.name]
            into["configs"].update(data["configs"])
            for requests, row in data["mixes"].items():
                into["mixes"].setdefault(requests, {}).update(row)
            continue
        merged[path] = data
        by_setup.setdefault(key, []).append(path)
    return merged


def report(folders: list[str], out: Path, name: str | None = None) -> list[Path]:
    """Rows of every result under `folders`, one set of files per machine (device and date, or
    `name` for all of them: the folders of one device session are one machine)."""
    rows, serving = [], []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.json")):
            if path.name.startswith(("bench_", "decode_")):
                rows += rows_from(path)
            elif path.name.startswith("serving_"):
                serving.append(path)
    for path, data in merge_serving(serving).items():
        rows += rows_from(path, data)
    if not rows:
        raise SystemExit(f"no results in {folders}")
    for row in rows:
        row["machine"] = name or row["machine"]
    written = []
    for machine in sorted({r["machine"] for r in rows}):
        mine = [r for r in rows if r["machine"] == machine]
        devices = sorted({r["device"] for r in mine})
        title = f"{', '.join(devices)}, {mine[0]['date']}"
        base = out / f"matrix_{machine}"
        save_json(f"{base}.json", {"machine": machine, "devices": devices, "bar": BAR, "rows": mine})
        Path(f"{base}.md").write_text(f"{title}\n\n{table(mine)}\n")
        plot(mine, title, Path(f"{base}.png"))
        written += [Path(f"{base}.{ext}") for ext in ("json", "md", "png")]
        slower = [r for r in mine if r["speed"] < BAR]
        print(f"{machine}: {len(mine)} rows, {len(slower)} below {BAR}" + "".join(
            f"\n  below: {r['path']} TP={r['tp']} {r['case']} {r['speed']:.3f}{below(r).replace('**below 0.98**', '')}"
            for r in slower))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan", help="list the stages")
    r = sub.add_parser("run", help="run stage groups in order")
    r.add_argument("groups", nargs="+", help="STAGE[@GPUS][:VAR=VALUE...][:--ARG=VALUE...], joined by + to run at the same time, "
                   "by > one after another")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results")) / "matrix")
    r.add_argument("--deadline", type=float, default=560, help="seconds for every group together")
    rep = sub.add_parser("report", help="JSON, table and plot per machine")
    rep.add_argument("folders", nargs="+")
    rep.add_argument("--out", type=Path, default=Path("docs/data/matrix"))
    rep.add_argument("--name", help="the machine's name in the file names (default: device and date)")
    args = p.parse_args(argv)
    if args.cmd == "plan":
        print(plan())
        return 0
    if args.cmd == "run":
        return run(args.groups, args.out, args.deadline)
    report(args.folders, args.out, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
