"""Accuracy harness (docs/accuracy.md): held-out loss / perplexity and teacher-forced logits of a
trained model, tensor parallel, each configuration against an fp32 run of the same weights.

    python benchmarks/train_tiny_llama.py --out ckpt/                                   # one GPU, minutes
    torchrun --nproc-per-node 2 benchmarks/eval_accuracy.py --model ckpt/ --out results/  # TP=2 (4 likewise)
    python benchmarks/train_tiny_llama.py --tiny --out /tmp/ck
    torchrun --nproc-per-node 2 benchmarks/eval_accuracy.py --tiny --model /tmp/ck --out /tmp/acc   # CPU/gloo

`--model` is any HF causal-LM checkpoint with a TP plan and a tokenizer (AutoTokenizer). The
text is the held-out split of Python's standard-library sources (`train_tiny_llama.heldout_split`:
the files the training script never saw), tokenized with the checkpoint's tokenizer, cut into
`--seqs` windows of `--seq-len` tokens; every configuration sees the same windows, one full
teacher-forced forward per window (no KV cache).

Reference: the checkpoint's weights as stored (bf16 for train_tiny_llama.py's), loaded in fp32 and
run eagerly, tensor parallel like the others. Configurations (CONFIGURATIONS below), all bf16:

  eager           HF's model, uncompiled
  compiled        torch.compile(model), no pass
  arfusion_exact  torch.compile with arfusion's pass:
                  PassConfig(enable_allreduce_fusion=True, backend=--backend)
  arfusion_fp8    the same + quantized_allreduce="fp8" (int8 / int6 / int4 likewise, by --configs),
                  quantized from --quantized-min-mb per rank (default 0: every site, the worst
                  case; the backend's crossover would leave small windows exact)

Per configuration: perplexity (exp of the mean next-token loss over every predicted position),
its relative change vs fp32 and vs compiled, the max (and mean) over positions of the logits'
relative L2 error vs fp32 (||l - l_fp32|| / ||l_fp32|| over the vocabulary), top-1 agreement with
fp32, and for arfusion configurations the sites the pass fused and the calls that ran a quantized
all-reduce (0 where the backend has no such level: it then ran exact, and says why in the log).
`checks` holds the accuracy bars against compiled: arfusion_exact: max logits rel err vs fp32
<= 1.1 x compiled's + --abs-slack and |perplexity change| <= 0.1%; arfusion_fp8: |perplexity
change| <= 1% (lossy: no logits bar). `--configs` selects which run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import math
import os
import sys
import time
from typing import Callable, Optional

if "--cpu" in sys.argv:
    # transformers' TP initialisation moves each rank to its accelerator whenever one is visible
    # (set_device(LOCAL_RANK) fails on a one-GPU machine), so hide CUDA before torch looks.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
import torch.distributed as dist

import arfusion
from arfusion.hf import prepare_for_compile, tp_kwargs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import rel_err_rows, save_json, top1_same  # noqa: E402
from train_tiny_llama import encode_stream, heldout_split, read_texts, windows  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Configuration:
    name: str
    compile: bool = False
    arfusion: bool = False  # compiled with arfusion's pass
    quantized: Optional[str] = None  # its quantized_allreduce level
    note: str = ""

    def pass_config(self, backend: str, world: int, quantized_min_mb: float) -> Optional["arfusion.PassConfig"]:
        if not self.arfusion:
            return None
        min_mb = {world: quantized_min_mb} if self.quantized and quantized_min_mb >= 0 else {}
        return arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend, quantized_allreduce=self.quantized,
                                   quantized_allreduce_min_mb=min_mb)


CONFIGURATIONS: list[Configuration] = [
    Configuration("eager", note="HF model, uncompiled"),
    Configuration("compiled", compile=True, note="plain torch.compile"),
    Configuration("arfusion_exact", compile=True, arfusion=True, note="torch.compile + arfusion (exact all-reduce)"),
    *(Configuration(f"arfusion_{level}", compile=True, arfusion=True, quantized=level,
                    note=f"torch.compile + arfusion, {level} quantized all-reduce")
      for level in arfusion.config.QUANTIZED_LEVELS),
]
DEFAULT_CONFIGS = ("eager", "compiled", "arfusion_exact", "arfusion_fp8")
# Bars per configuration, against "compiled": (max-logits-rel-err factor, max |ppl change vs compiled|).
BARS: dict[str, tuple[float, float]] = {"arfusion_exact": (1.1, 1e-3), "arfusion_fp8": (math.inf, 1e-2)}


def held_out_windows(tokenizer, seq_len: int, seqs: int, heldout_pct: int) -> torch.Tensor:
    root, _, held = heldout_split(heldout_pct=heldout_pct)
    # Enough text for the windows with room for any tokenizer (>= 1 byte per token): 8 bytes a token.
    texts = read_texts(root, held, max(8 * seq_len * seqs, 100_000))
    return windows(encode_stream(tokenizer, texts), seq_len, seqs)


class Accumulator:
    """Streaming statistics of one configuration against the fp32 reference."""

    def __init__(self):
        self.loss_sum = 0.0
        self.tokens = 0
        self.rel_max = 0.0
        self.rel_sum = 0.0
        self.positions = 0
        self.top1_same = 0

    def add(self, logits: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor):
        logits = logits.float()
        self.loss_sum += torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        self.tokens += ids[:, 1:].numel()
        rel = rel_err_rows(logits, ref)
        self.rel_max = max(self.rel_max, rel.max().item())
        self.rel_sum += rel.sum().item()
        self.positions += rel.numel()
        self.top1_same += top1_same(logits, ref).sum().item()

    def result(self) -> dict:
        loss = self.loss_sum / self.tokens
        return {"loss": loss, "perplexity": math.exp(loss), "logits_rel_err_max": self.rel_max,
                "logits_rel_err_mean": self.rel_sum / self.positions, "top1_agreement": self.top1_same / self.positions,
                "positions": self.positions}


def evaluate(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))
        import shared_gpu  # NCCL, one GPU per rank; or --shared-gpu: gloo, every rank on GPU 0

        shared_gpu.init(args.shared_gpu)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = args.backend or ("flashinfer" if cuda else "torch")
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    t_start = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = held_out_windows(tokenizer, args.seq_len, args.seqs, args.heldout_pct)
    if data.shape[0] == 0:
        raise SystemExit("no held-out text: lower --seq-len")
    ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                     **tp_kwargs("auto", config=args.model)).eval()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 **tp_kwargs("auto", config=args.model)).eval()
    prepare_for_compile(model)  # graph breaks in HF code: q/k norm hooks (<= 5.17), looped experts
    c = model.config
    say(f"{args.model}: {c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}; "
        f"TP={world} on {torch.cuda.get_device_name() if cuda else 'cpu'}; {data.shape[0]} held-out windows of "
        f"{args.seq_len} tokens; backend {backend}")

    configs = [cfg for cfg in CONFIGURATIONS if cfg.name in (args.configs or DEFAULT_CONFIGS)]
    runners, fused, quantized_calls = {}, {}, {}
    for cfg in configs:
        if not cfg.compile:
            runners[cfg.name] = model
        else:
            config = cfg.pass_config(backend, world, args.quantized_min_mb)
            options = dict(arfusion.inductor_options(config)) if config else None
            runners[cfg.name] = torch.compile(model, options=options)
        fused[cfg.name] = quantized_calls[cfg.name] = 0
    dispatched = {cfg.name: collections.Counter() for cfg in configs}  # fused-op calls by backend / "fallback"
    acc = {cfg.name: Accumulator() for cfg in configs}
    ref_acc = Accumulator()
    with torch.no_grad():
        for start in range(0, data.shape[0], args.batch):
            ids = data[start:start + args.batch].to(device)
            if ids.shape[0] < args.batch and start:  # one shape per compile
                break
            ref = ref_model(input_ids=ids).logits.float()
            ref_acc.add(ref, ref, ids)
            for cfg in configs:
                before = arfusion.stats()["fused_sites"], _quantized_calls(), dict(arfusion.stats()["dispatch"])
                logits = runners[cfg.name](input_ids=ids).logits
                fused[cfg.name] += arfusion.stats()["fused_sites"] - before[0]
                quantized_calls[cfg.name] += _quantized_calls() - before[1]
                dispatched[cfg.name].update(collections.Counter(arfusion.stats()["dispatch"]) - collections.Counter(before[2]))
                acc[cfg.name].add(logits, ref, ids)
            say(f"window {start + ids.shape[0]}/{data.shape[0]} ({time.time() - t_start:.0f} s)")

    rows = {"fp32": {**ref_acc.result(), "note": "same weights, fp32, eager"}}
    for cfg in configs:
        rows[cfg.name] = {**acc[cfg.name].result(), "note": cfg.note}
        if cfg.arfusion:
            rows[cfg.name]["fused_sites"] = fused[cfg.name]
            rows[cfg.name]["quantized_calls"] = quantized_calls[cfg.name]
            rows[cfg.name]["dispatch"] = dict(dispatched[cfg.name])
    for name, r in rows.items():
        r["ppl_rel_vs_fp32"] = r["perplexity"] / rows["fp32"]["perplexity"] - 1
        if "compiled" in rows:
            r["ppl_rel_vs_compiled"] = r["perplexity"] / rows["compiled"]["perplexity"] - 1
    checks = {}
    if "compiled" in rows:
        for name, (factor, ppl_tol) in BARS.items():
            if name not in rows:
                continue
            bound = factor * rows["compiled"]["logits_rel_err_max"] + args.abs_slack if math.isfinite(factor) else math.inf
            checks[name] = {
                "logits_rel_err_max": rows[name]["logits_rel_err_max"], "bound": bound,
                "logits_ok": rows[name]["logits_rel_err_max"] <= bound,
                "ppl_rel_vs_compiled": rows[name]["ppl_rel_vs_compiled"], "ppl_tolerance": ppl_tol,
                "ppl_ok": abs(rows[name]["ppl_rel_vs_compiled"]) <= ppl_tol,
                "bar": (f"max logits rel err vs fp32 <= {factor} x compiled's + {args.abs_slack}; "
                        if math.isfinite(factor) else "") + f"|ppl change vs compiled| <= {100 * ppl_tol:g}%"}
    meta = {"model": args.model, "model_type": c.model_type, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
            "vocab": c.vocab_size, "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "shared_gpu": bool(cuda and args.shared_gpu),
            "backend": backend, "quantized_min_mb": args.quantized_min_mb, "seq_len": args.seq_len, "windows": int(data.shape[0]), "batch": args.batch,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "python": sys.version.split()[0], "seconds": round(time.time() - t_start, 1),
            "command": f"torchrun --nproc-per-node {world} benchmarks/eval_accuracy.py " + " ".join(args.argv)}
    train_meta = os.path.join(args.model, "train_meta.json")
    if os.path.exists(train_meta):
        with open(train_meta) as f:
            meta["train"] = {k: v for k, v in json.load(f).items() if k != "history"}
    result = {"meta": meta, "configurations": rows, "checks": checks}
    del runners, model, ref_model
    torch._dynamo.reset()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def _quantized_calls() -> int:
    return sum(n for name, n in arfusion.stats()["dispatch"].items() if " quantized " in name)


def markdown(result: dict) -> str:
    m, rows = result["meta"], result["configurations"]
    lines = [f"{m['model_type']} {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}; TP={m['world']} on "
             f"{m['device']}, backend {m['backend']}; {m['windows']} held-out windows x {m['seq_len']} tokens; "
             f"torch {m['torch']}, transformers {m['transformers']}", "",
             "| configuration | perplexity | vs fp32 | vs compiled | max logits rel err vs fp32 | mean | top-1 vs fp32 "
             "| quantized all-reduce calls |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        vs_c = f"{100 * r['ppl_rel_vs_compiled']:+.4f}%" if "ppl_rel_vs_compiled" in r else "-"
        lines.append(f"| {name} | {r['perplexity']:.4f} | {100 * r['ppl_rel_vs_fp32']:+.4f}% | {vs_c} | "
                     f"{r['logits_rel_err_max']:.3e} | {r['logits_rel_err_mean']:.3e} | "
                     f"{100 * r['top1_agreement']:.2f}% | {r.get('quantized_calls', '-')} |")
    for name, ch in result["checks"].items():
        logits = (f"logits {'OK' if ch['logits_ok'] else 'FAIL'} ({ch['logits_rel_err_max']:.3e} <= "
                  f"{ch['bound']:.3e}), " if math.isfinite(ch["bound"]) else "")
        lines.append("")
        lines.append(f"{name} vs compiled: {ch['bar']}: {logits}perplexity "
                     f"{'OK' if ch['ppl_ok'] else 'FAIL'} ({100 * ch['ppl_rel_vs_compiled']:+.4f}%)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF causal-LM checkpoint (e.g. train_tiny_llama.py's --out)")
    p.add_argument("--tiny", action="store_true", help="few short windows: CPU/gloo, seconds of evaluation")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seqs", type=int, default=64, help="held-out windows")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heldout-pct", type=int, default=5, help="as train_tiny_llama.py was run with")
    p.add_argument("--backend", default=None, choices=["flashinfer", "aiter", "torch", "auto"],
                   help="arfusion backend (default: flashinfer on CUDA, torch on CPU)")
    p.add_argument("--configs", nargs="+", default=None, help=f"default {' '.join(DEFAULT_CONFIGS)}; any of: "
                   + ", ".join(c.name for c in CONFIGURATIONS))
    p.add_argument("--quantized-min-mb", type=float, default=0.0,
                   help="per-rank MiB from which quantized configurations quantize (default 0: every site; "
                        "-1: the backend's own crossover)")
    p.add_argument("--abs-slack", type=float, default=0.0,
                   help="absolute slack on the logits bar (tiny models: their fp32 error is tiny too)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA exists")
    p.add_argument("--shared-gpu", action="store_true",
                   help="a one-GPU machine: every rank on GPU 0 over gloo (tests/gpu/shared_gpu.py); FlashInfer's "
                        "exact kernels run (the quantized all-reduce needs one GPU per rank)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.argv = argv
    if args.tiny:
        args.seq_len, args.seqs, args.batch = 64, 4, 4
    result = evaluate(args)
    if result is None:
        return
    table = markdown(result)
    print(table, flush=True)
    if args.out:
        stem = os.path.join(args.out, f"accuracy_{result['meta']['model_type']}_w{result['meta']['world']}")
        save_json(stem + ".json", result)
        with open(stem + ".md", "w") as f:
            f.write(table + "\n")
        print(f"wrote {stem}.json, {stem}.md", flush=True)


if __name__ == "__main__":
    main()
