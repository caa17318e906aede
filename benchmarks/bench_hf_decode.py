"""End to end: a tensor-parallel HF model's decode and prefill, with and without arfusion.

    torchrun --nproc-per-node 2 benchmarks/bench_hf_decode.py --out results/    # 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/bench_hf_decode.py --tiny            # CPU/gloo, seconds
    python benchmarks/bench_hf_decode.py --plot results/decode_llama_w2.json results/decode_llama_w4.json
    torchrun --nproc-per-node 1 benchmarks/bench_hf_decode.py --rank-of 2 --phases decode   # TP=2's floor

An HF model built from a config (Llama-3-8B shape by default; --model-type qwen3, gemma,
qwen3_moe (Qwen3-30B-A3B) or deepseek_v2 (DeepSeek-V2-Lite) for those architectures), random
bf16 weights, loaded with `tp_plan="auto"`, static KV cache, compiled twice: "off" (plain torch.compile) and "on" (the same with arfusion's pass). Both share the
weights; each has its own caches. In one run, phase by phase (each phase writes the JSON again,
so a run cut short keeps what it measured):

  startup   compile + first decode token at batch 1, cold (fresh FX graph cache) and warm (the
            same cache after torch._dynamo.reset()), arfusion's config first; the pass's own time
            from arfusion.stats()
  decode    the headline: the whole compiled decode step captured in one CUDA graph and replayed,
            median ms per step over --replays replays (CUDA events), batch 1, 8, 32; tokens/s
  accuracy  teacher forcing: the same prompt and the same --steps tokens fed to eager, off and on
            (and to the same weights run in fp32, the reference all three are measured against);
            per step the logits' relative L2 error against eager and between on and off, and
            top-1 agreement (random weights make near ties common: both numbers, not one)
  prefill   one compiled (dynamic length) prefill captured per length (512, 2048), batch 1,
            last-token logits as serving engines compute them; ms and tokens/s. With
            --quantized fp8 a third config, "quantized": the pass with quantized_allreduce="fp8"
            (the backend's crossover decides per site), its speedups and how many of the op's
            calls in one prefill ran the quantized all-reduce (on CPU the torch backend emulates
            it at every size)
  kernels   PyTorch profiler over uncaptured compiled decode steps: kernels and GPU time per step,
            by kind (NCCL, fused all-reduce, Triton, GEMM, attention, other)
  loop      a plain decode loop with mode="reduce-overhead" (cudagraph trees), greedy, wall ms per
            token and the GPU-busy fraction (captured step time / wall time): host-bound, as
            measured before arfusion existed
  generate  HF generate() with a static cache and its own compile: wall ms per new token, and
            how many sites the pass fused in the graph generate compiled

On CPU (gloo) CUDA graphs, the profiler's kernels and reduce-overhead do not exist: decode and
prefill are timed as plain compiled calls, and the loop phase uses the default compile mode.

--rank-of N: one process, no TP, a model holding one rank's share of the TP=N model (heads,
intermediates, vocabulary divided by N): the TP=N step without any communication, the floor no
all-reduce fusion can go below (docs/benchmarks.md, "One H200, 2026-11-25").
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch._dynamo.utils

import arfusion
from arfusion.backends import get_backend
from arfusion.config import QUANTIZED_LEVELS
from arfusion.hf import prepare_for_compile, tp_kwargs

# Real models' shapes (random weights): Llama-3-8B, Qwen3-8B, Gemma-7B, Qwen3-30B-A3B, DeepSeek-V2-Lite.
PRESETS = {
    "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=12288, vocab_size=151936, head_dim=128, max_position_embeddings=8192),
    "gemma": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=24576, vocab_size=256000, head_dim=256, max_position_embeddings=8192),
    # MoE (issue 13): Qwen3-30B-A3B and DeepSeek-V2-Lite (use --layers to shorten them)
    "qwen3_moe": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=8192),
    "deepseek_v2": dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
                        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                        vocab_size=102400, max_position_embeddings=8192),
}
# --tiny for the MoE presets: few small experts, and MLA ranks that fit hidden 256.
TINY_MOE = {
    "qwen3_moe": dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2),
    "deepseek_v2": dict(moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32),
}
REWRITE_COUNTS = ("fused_sites", "unfused_sites", "summed_all_reduces_merged", "gated_all_reduces_merged",
                  "sums_moved_before_all_reduce", "scaled_all_reduces_fused",
                  "moe_combines_fused")
PHASES = ("startup", "decode", "accuracy", "prefill", "kernels", "loop", "generate")
CONFIGS = ("off", "on")
LOOP_CHUNKS = 4  # the reduce-overhead loop's timed steps, in chunks (median chunk reported)
KERNEL_KINDS = (  # first match wins; lower-case substrings of kernel names
    ("fused_allreduce", ("allreduce_fusion", "allreducefusion", "fused_allreduce")),
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("triton", ("triton",)),
)


def model_config(args, world: int):
    from transformers import AutoConfig

    if args.tiny:
        world = max(world, args.rank_of)  # --rank-of: the TP=N model's shape, then one rank's share
        heads = max(4, 2 * world)
        shape = dict(hidden_size=256, num_hidden_layers=args.layers or 2, num_attention_heads=heads,
                     num_key_value_heads=world, intermediate_size=512, vocab_size=512,
                     max_position_embeddings=4096, head_dim=256 // heads)
        shape.update(TINY_MOE.get(args.model_type, {}))
        if args.model_type == "deepseek_v2":
            shape["num_key_value_heads"] = heads  # MLA: no grouped KV heads
    else:
        shape = dict(PRESETS[args.model_type])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
    if args.rank_of > 1:
        shape = one_rank_shape(shape, args.rank_of)
    return AutoConfig.for_model(args.model_type, tie_word_embeddings=False, **shape)


# What one rank of TP=N holds of each sharded width (transformers' TP plans: attention heads,
# MLP and expert intermediates, the vocabulary of the embedding and lm_head); the router, the
# MLA down-projections and the norms are replicated.
RANK_SHARDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "vocab_size")


def one_rank_shape(shape: dict, n: int) -> dict:
    """--rank-of N: one rank's share of a TP=N model as a model of its own, run at world size 1
    with no communication at all: its decode step is the floor under the TP=N step, so
    1 - floor / unfused step bounds what any all-reduce fusion can gain."""
    out = dict(shape)
    if "head_dim" not in out and "qk_nope_head_dim" not in out:  # keep the heads' width
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    for key in RANK_SHARDED:
        if key in out:
            if out[key] % n:
                raise SystemExit(f"--rank-of {n}: {key} = {out[key]} does not split in {n}")
            out[key] //= n
    return out


# Output projections of each residual branch: scaled by 1/sqrt(2 * layers) with --init scaled
# (GPT-2 / Megatron's residual init), so each layer adds a small update to the residual stream
# as in trained models, instead of a contribution as large as the stream itself.
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


def random_checkpoint(config, device, root: str | None, init: str = "hf") -> str:
    """Rank 0 writes random weights once per config (initialised on its device: fast on a GPU);
    every rank then loads them tensor parallel. Reused when the same config was written before."""
    key = hashlib.sha256((config.to_json_string(use_diff=False) + init).encode()).hexdigest()[:12]
    path = os.path.join(root or tempfile.gettempdir(), f"arfusion-bench-{config.model_type}-{key}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "complete")):
        from transformers import AutoModelForCausalLM

        shutil.rmtree(path, ignore_errors=True)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if init == "scaled":
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if any(f".{proj}." in name for proj in RESIDUAL_OUTPUTS):
                        param.mul_((2 * config.num_hidden_layers) ** -0.5)
        model.save_pretrained(path)
        open(os.path.join(path, "complete"), "w").close()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return path


class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.cpu
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if self.cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        torch._dynamo.config.recompile_limit = 64  # off and on, per batch shape, share model.forward
        torch._dynamo.config.accumulated_recompile_limit = 1024
        # Only the sizes marked dynamic here are: an unplanned recompile stays static.
        torch._dynamo.config.automatic_dynamic_shapes = False
        self.result = {"meta": {}, "phases": {}}
        self.started = time.time()
        self.pass_config = arfusion.PassConfig(enable_allreduce_fusion=True, backend=args.backend)
        self.quantized_config = arfusion.PassConfig(enable_allreduce_fusion=True, backend=args.backend,
                                                    quantized_allreduce=args.quantized)
        if self.rank == 0:  # what the pass fused and declined, one line per graph
            import logging

            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[arfusion] %(message)s"))
            logging.getLogger("arfusion").addHandler(handler)
            logging.getLogger("arfusion").setLevel(logging.INFO)

    def say(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    # ------------------------------------------------------------------ setup

    def load(self):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.config = model_config(self.args, self.world)
        t0 = time.perf_counter()
        path = self.checkpoint = random_checkpoint(self.config, self.device, self.args.ckpt_dir, self.args.init)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **self.tp()).eval()
        prepare_for_compile(self.model)  # graph breaks in HF code: q/k norm hooks (<= 5.17), looped experts
        c = self.config
        self.result["meta"] = {
            "model_type": c.model_type, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
            "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "intermediate": c.intermediate_size, "vocab": c.vocab_size, "world": self.world,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "arfusion": arfusion.__version__,
            "backend": self.args.backend, "init": self.args.init, "rank_of": self.args.rank_of,
            "load_s": round(time.perf_counter() - t0, 1),
            "command": "torchrun --nproc-per-node %d benchmarks/bench_hf_decode.py %s" % (
                self.world, " ".join(self.args.argv))}
        self.say(f"{c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, TP={self.world} on "
                 f"{self.result['meta']['device']}, loaded in {self.result['meta']['load_s']} s")
        self.compiled = {}

    def tp(self) -> dict:
        """Tensor parallel over the ranks, or nothing for --rank-of (one rank's share, no TP)."""
        return tp_kwargs("auto") if self.args.rank_of <= 1 else {"device_map": self.device}

    def compile(self, name: str, reduce_overhead: bool = False):
        """model compiled without ("off") or with ("on") the pass, or with it and the quantized
        all-reduce ("quantized"); per-compile options so they coexist in one process."""
        config = {"on": self.pass_config, "quantized": self.quantized_config}.get(name)
        options = dict(arfusion.inductor_options(config)) if config else {}
        if reduce_overhead and self.cuda:
            options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets
        return torch.compile(self.model, options=options or None)

    def compiled_model(self, name: str):
        """The decode-step compile of a config, made once and shared by the phases."""
        if name not in self.compiled:
            self.compiled[name] = self.compile(name)
        return self.compiled[name]

    def cache(self, max_len: int):
        from transformers import StaticCache  # sized by its first update (batch, heads)

        return StaticCache(config=self.config, max_cache_len=max_len)

    def prompt(self, batch: int, length: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config.vocab_size, (batch, length), generator=g).to(self.device)

    def prefilled(self, batch: int, model=None):
        """A static cache holding the same eager prefill for every config. One cache length for
        every phase: a new length would recompile the decode step (with dynamic sizes)."""
        cache = self.cache(self.args.prompt + 2 * self.args.steps + 16)
        with torch.no_grad():
            out = (model or self.model)(input_ids=self.prompt(batch, self.args.prompt), past_key_values=cache,
                                        use_cache=True)
        return cache, out.logits[:, -1:].argmax(-1)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def save(self):
        self.result["meta"]["seconds"] = round(time.time() - self.started)
        if self.rank == 0 and self.args.out:
            os.makedirs(self.args.out, exist_ok=True)
            tag = f"_{self.args.tag}" if self.args.tag else ""
            path = os.path.join(self.args.out, f"decode_{self.config.model_type}_w{self.world}{tag}.json")
            with open(path, "w") as f:
                json.dump(self.result, f, indent=1)

    # ------------------------------------------------------------------ timing helpers

    def time_step(self, fn, reset, warmup: int = 3):
        """Median ms of fn(): replays of one CUDA graph holding the whole call (GPU), or plain
        timed calls (CPU). reset() runs before each call, outside the timed region."""
        replays = self.args.replays
        with torch.no_grad():
            for _ in range(warmup):  # compiles, creates workspaces, autotunes: never in capture
                reset()
                fn()
            self.sync()
            if not self.cuda:
                times = []
                for _ in range(max(3, replays // 10)):
                    reset()
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
                return statistics.median(times)
            graph = torch.cuda.CUDAGraph()
            reset()
            with torch.cuda.graph(graph):
                fn()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(replays)]
            dist.barrier()
            torch.cuda.synchronize()
            for start, end in events:
                reset()
                start.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in events)
            del graph
        # Ranks replay the same collectives; report the slowest rank's median.
        t = torch.tensor([ms], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    @staticmethod
    def rewinder(cache, length: int):
        """Puts a static cache back to `length` tokens, so every replay decodes the same position."""
        counters = [layer.cumulative_length for layer in cache.layers
                    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

        def reset():
            for c in counters:
                c.fill_(length)

        return reset

    # ------------------------------------------------------------------ phases

    @contextlib.contextmanager
    def cache_dir(self, name: str):
        """An Inductor cache directory per config, and no compiled kernels kept in memory from
        earlier compiles: cold is cold, and warm reads only what the disk cache holds."""
        from torch._inductor.utils import clear_caches

        clear_caches()
        root = self.args.cache_root or tempfile.gettempdir()
        path = os.path.join(root, f"arfusion-bench-inductor-{name}-r{self.rank}-{os.getpid()}")
        saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        try:
            yield path
        finally:
            if saved is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved

    def first_token(self, name: str) -> dict:
        cache, token = self.prefilled(1)
        before = arfusion.stats()
        dist.barrier()
        t0 = time.perf_counter()
        fn = self.compile(name)
        with torch.no_grad():
            fn(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1).tolist()
        seconds = time.perf_counter() - t0
        after = arfusion.stats()
        self.compiled[name] = fn
        return {"seconds": round(seconds, 2), "fused_sites": after["fused_sites"] - before["fused_sites"],
                "pass_seconds": round(after["pass_seconds"] - before["pass_seconds"], 3)}

    def warm_up_compiler(self):
        """Process-wide first-compile costs (imports, dynamo's and AOT's first trace of this
        model, compile workers) go here, not into whichever config is compiled cold first."""
        with self.cache_dir("warmup"):
            norm = torch.compile(lambda x, w: w * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype))
            x = torch.randn(4, 64, device=self.device, dtype=torch.bfloat16)
            norm(x, torch.ones(64, device=self.device, dtype=torch.bfloat16))
            cache, token = self.prefilled(1)
            with torch.no_grad():
                torch.compile(self.model, backend="aot_eager")(input_ids=token, past_key_values=cache, use_cache=True)
        torch._dynamo.reset()

    def phase_startup(self):
        torch._inductor.config.fx_graph_cache = True
        self.warm_up_compiler()
        out = {}
        for temperature in ("cold", "warm"):
            if temperature == "warm":
                torch._dynamo.reset()  # forget compiled code; the on-disk caches stay
            for name in ("on", "off"):  # a bias of going first falls on arfusion, not for it
                with self.cache_dir(name) as path:
                    if temperature == "cold":
                        shutil.rmtree(path, ignore_errors=True)
                    out[f"{temperature}_{name}"] = self.first_token(name)
                self.say(f"startup {temperature} {name}: {out[f'{temperature}_{name}']}")
        out["cold_added_s"] = round(out["cold_on"]["seconds"] - out["cold_off"]["seconds"], 2)
        out["order"] = ("cold on, cold off, dynamo reset, warm on, warm off; batch 1 decode step; a cache dir "
                        "per config, in-memory kernel caches cleared before each")
        return out

    def phase_decode(self):
        rows = []
        for batch in self.args.batches:
            row = {"batch": batch}
            for name in CONFIGS:
                fn = self.compiled_model(name)
                cache, token = self.prefilled(batch)
                if batch > 1:  # one dynamic-batch graph serves every batch > 1 (1 specializes)
                    torch._dynamo.maybe_mark_dynamic(token, 0)
                    for layer in cache.layers:
                        for t in (layer.keys, layer.values):
                            torch._dynamo.maybe_mark_dynamic(t, 0)
                before = arfusion.stats()
                step = lambda cache=cache: fn(input_ids=token, past_key_values=cache, use_cache=True).logits
                row[f"{name}_ms"] = self.time_step(step, self.rewinder(cache, self.args.prompt))
                row[f"{name}_dispatch"] = dispatch_since(before)
                del cache
            row["speedup"] = round(row["off_ms"] / row["on_ms"], 3)
            row["gain_pct"] = round(100 * (1 - row["on_ms"] / row["off_ms"]), 1)
            row["on_tokens_per_s"] = round(batch * 1e3 / row["on_ms"], 1)
            row["off_tokens_per_s"] = round(batch * 1e3 / row["off_ms"], 1)
            self.say(f"decode batch {batch}: off {row['off_ms']:.3f} ms, on {row['on_ms']:.3f} ms, "
                     f"{row['gain_pct']:+.1f}% ({row['on_dispatch']})")
            rows.append(row)
        # What the pass did to the graphs timed here (MoE: all-reduces merged or moved).
        stats = arfusion.stats()
        done = {k: v for k, v in stats.items() if k in REWRITE_COUNTS and v}
        self.say(f"pass: {done}, forms {stats['by_pattern']}")
        return {"rows": rows, "captured": self.cuda, "replays": self.args.replays, "context": self.args.prompt,
                "pass": done, "by_pattern": stats["by_pattern"]}

    def phase_accuracy(self):
        steps = self.args.steps
        forced = self.prompt(1, steps, seed=7)  # the tokens fed at every step, same for all
        logits = {}
        # The same bf16 weights run in fp32, eagerly: how far each bf16 run is from the exact
        # result, so "on" can be compared with "off" against the truth and not only each other.
        from transformers import AutoModelForCausalLM

        exact = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=torch.float32, **self.tp()).eval()
        for name in ("fp32", "eager", *CONFIGS):
            fn = {"fp32": exact, "eager": self.model}[name] if name in ("fp32", "eager") else self.compiled_model(name)
            cache, _ = self.prefilled(1, model=fn if name == "fp32" else None)
            per_step = []
            with torch.no_grad():
                for i in range(steps):
                    token = forced[:, i:i + 1].clone()  # a fresh tensor, like a real decode loop's
                    out = fn(input_ids=token, past_key_values=cache, use_cache=True).logits
                    per_step.append(out[0, -1].float().clone())
            logits[name] = torch.stack(per_step)
        del exact, cache
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

        def rel(a, b):
            return ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()

        def agree(a, b):
            return (a.argmax(-1) == b.argmax(-1)).float().tolist()

        out = {"steps": steps,
               "on_vs_off_rel_l2": rel(logits["on"], logits["off"]),
               "on_vs_eager_rel_l2": rel(logits["on"], logits["eager"]),
               "off_vs_eager_rel_l2": rel(logits["off"], logits["eager"]),
               "on_vs_off_top1": agree(logits["on"], logits["off"]),
               "on_vs_eager_top1": agree(logits["on"], logits["eager"]),
               "off_vs_eager_top1": agree(logits["off"], logits["eager"])}
        for name in ("eager", *CONFIGS):
            out[f"{name}_vs_fp32_rel_l2"] = rel(logits[name], logits["fp32"])
            out[f"{name}_vs_fp32_top1"] = agree(logits[name], logits["fp32"])
        summary = {k.replace("_rel_l2", "_max_rel_l2"): max(v) for k, v in out.items() if k.endswith("rel_l2")}
        summary.update({k: statistics.mean(v) for k, v in out.items() if k.endswith("top1")})
        out["summary"] = summary
        self.say(f"accuracy over {steps} teacher-forced steps: {json.dumps({k: round(v, 4) for k, v in summary.items()})}")
        return out

    def phase_prefill(self):
        rows = []
        names = CONFIGS + (("quantized",) if self.args.quantized else ())
        fns = {name: self.compile(name) for name in names}  # its own graph: lengths dynamic
        for length in self.args.prefill:
            ids = self.prompt(1, length, seed=3)
            torch._dynamo.mark_dynamic(ids, 1)
            row = {"tokens": length}
            for name, fn in fns.items():
                step = lambda: fn(input_ids=ids, use_cache=False, logits_to_keep=1).logits
                row[f"{name}_ms"] = self.time_step(step, lambda: None, warmup=2)
                row[f"{name}_tokens_per_s"] = round(length * 1e3 / row[f"{name}_ms"], 1)
                before = arfusion.stats()  # what the op ran in one more (uncaptured) prefill
                with torch.no_grad():
                    step()
                row[f"{name}_dispatch"] = dispatch_since(before)
            row["on_vs_off"] = round(row["on_ms"] / row["off_ms"], 4)
            row["on_speedup"] = round(row["off_ms"] / row["on_ms"], 3)
            line = f"prefill {length}: off {row['off_ms']:.2f} ms, on {row['on_ms']:.2f} ms ({row['on_speedup']:.3f}x)"
            if "quantized" in fns:
                row["quantized_speedup"] = round(row["off_ms"] / row["quantized_ms"], 3)
                row["quantized_vs_on"] = round(row["on_ms"] / row["quantized_ms"], 3)
                row["quantized_calls"] = sum(v for k, v in row["quantized_dispatch"].items() if " quantized " in k)
                row["op_calls"] = sum(row["quantized_dispatch"].values())
                line += (f", {self.args.quantized} {row['quantized_ms']:.2f} ms ({row['quantized_speedup']:.3f}x, "
                         f"{row['quantized_vs_on']:.3f}x vs on; {row['quantized_calls']}/{row['op_calls']} calls quantized)")
            self.say(line)
            rows.append(row)
        return {"rows": rows, "batch": 1, "quantized": self.args.quantized}

    def phase_kernels(self):
        if not self.cuda:
            return {"skipped": "no CUDA: the profiler sees no GPU kernels"}
        from torch.profiler import ProfilerActivity, profile

        steps, out = 5, {}
        for name in CONFIGS:
            fn = self.compiled_model(name)
            cache, token = self.prefilled(1)  # room for warm-up and profiled steps: no rewinds
            with torch.no_grad():
                for _ in range(3):
                    fn(input_ids=token, past_key_values=cache, use_cache=True)
                self.sync()
                dist.barrier()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        fn(input_ids=token, past_key_values=cache, use_cache=True)
                    self.sync()
            kinds: dict[str, list] = {}
            for evt in prof.events():
                if evt.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                kind = next((k for k, keys in KERNEL_KINDS if any(s in evt.name.lower() for s in keys)), "other")
                kinds.setdefault(kind, [0, 0.0])
                kinds[kind][0] += 1
                kinds[kind][1] += evt.time_range.elapsed_us()
            out[name] = {k: {"kernels": round(n / steps, 1), "gpu_us": round(us / steps, 1)} for k, (n, us) in kinds.items()}
            out[name]["total"] = {"kernels": round(sum(n for n, _ in kinds.values()) / steps, 1),
                                  "gpu_us": round(sum(us for _, us in kinds.values()) / steps, 1)}
            self.say(f"kernels per decode step, {name}: {out[name]['total']}")
        saved = out["off"]["total"]["kernels"] - out["on"]["total"]["kernels"]
        out["kernels_saved_per_step"] = round(saved, 1)
        out["kernels_saved_per_layer"] = round(saved / self.config.num_hidden_layers, 2)
        out["note"] = "5 uncaptured compiled steps at batch 1, per step"
        return out

    @staticmethod
    @contextlib.contextmanager
    def cudagraph_tree_work(tally: dict):
        """Counts what cudagraph trees do per call (eager warm-ups, recordings, replays): a loop
        that keeps warming up or re-recording is host-bound for a reason other than Python."""
        if not torch.cuda.is_available():
            yield tally
            return
        from torch._inductor import cudagraph_trees as trees

        manager = trees.CUDAGraphTreeManager
        saved = {name: getattr(manager, name) for name in ("run_eager", "record_function", "execute_node")}

        def counting(name):
            def wrapper(*a, **k):
                tally[name] = tally.get(name, 0) + 1
                return saved[name](*a, **k)
            return wrapper

        for name in saved:
            setattr(manager, name, counting(name))
        try:
            yield tally
        finally:
            for name, fn in saved.items():
                setattr(manager, name, fn)

    def phase_loop(self):
        steps, rows = self.args.steps, {}
        for name in self.args.loop_order:
            fn = self.compile(name, reduce_overhead=True)
            cache, token = self.prefilled(1)
            # A host-bound loop is noisy: the timed steps run in LOOP_CHUNKS chunks, and the
            # median chunk is reported. (Rewinding the cache between runs instead made cudagraph
            # trees re-record with live pool tensors and fail, on 4xH200.)
            chunks = [steps // LOOP_CHUNKS + (i < steps % LOOP_CHUNKS) for i in range(LOOP_CHUNKS)]
            counters = torch._dynamo.utils.counters
            samples, graphs, skips = [], counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
            warm, timed = {}, {}
            with torch.no_grad():
                with self.cudagraph_tree_work(warm):
                    for _ in range(3):  # cudagraph trees record on the first calls
                        token = fn(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                self.sync()
                dist.barrier()
                with self.cudagraph_tree_work(timed):
                    for chunk in (c for c in chunks if c):
                        t0 = time.perf_counter()
                        for _ in range(chunk):
                            token = fn(input_ids=token, past_key_values=cache,
                                       use_cache=True).logits[:, -1:].argmax(-1)
                        self.sync()
                        samples.append(round((time.perf_counter() - t0) * 1e3 / chunk, 3))
            rows[f"{name}_cudagraph_calls_warmup"] = warm
            rows[f"{name}_cudagraph_calls_timed"] = timed
            rows[f"{name}_ms_per_token"] = statistics.median(samples)
            rows[f"{name}_ms_per_token_chunks"] = samples
            rows[f"{name}_graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs  # includes warm-up
            rows[f"{name}_cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
        decode = self.result["phases"].get("decode", {}).get("rows", [])
        step = next((r for r in decode if r["batch"] == 1), None)
        if step and self.cuda:
            for name in CONFIGS:
                rows[f"{name}_gpu_busy"] = round(step[f"{name}_ms"] / rows[f"{name}_ms_per_token"], 3)
        rows["mode"] = "reduce-overhead" if self.cuda else "default (CPU)"
        self.say(f"decode loop: {rows}")
        return rows

    def phase_generate(self):
        from transformers import GenerationConfig

        new = self.args.steps
        ids = self.prompt(1, self.args.prompt, seed=5)
        out = {}
        for name in CONFIGS:
            torch._dynamo.reset()  # generate compiles its own call; the pass is read at compile time
            if hasattr(self.model, "_compiled_call"):
                del self.model._compiled_call  # HF keeps it per compile config, not per pass
            if name == "on":
                arfusion.enable(self.pass_config)
            before = arfusion.stats()
            gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                   cache_implementation="static")
            if not self.cuda:  # HF compiles generate's decode only on CUDA unless told otherwise
                from transformers import CompileConfig

                gen.compile_config = CompileConfig(dynamic=False)
                gen.compile_config._compile_all_devices = True
            try:
                with torch.no_grad():
                    self.model.generate(ids, generation_config=gen)  # compiles, records graphs
                    self.sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    self.model.generate(ids, generation_config=gen)
                    self.sync()
                seconds = time.perf_counter() - t0
            finally:
                arfusion.disable()
            after = arfusion.stats()
            out[name] = {"ms_per_token": round(seconds * 1e3 / new, 3), "new_tokens": new,
                         "fused_sites": after["fused_sites"] - before["fused_sites"]}
            self.say(f"generate {name}: {out[name]}")
        return out

    def run(self):
        self.load()
        deadline = self.started + self.args.budget_s if self.args.budget_s else None
        for phase in self.args.phases:
            if deadline and time.time() > deadline:
                self.result["phases"][phase] = {"skipped": "time budget (--budget-s) spent"}
                self.say(f"{phase}: skipped, time budget spent")
                continue
            t0 = time.time()
            try:
                result = getattr(self, f"phase_{phase}")()
            except Exception as e:  # the same shapes on every rank: an error is every rank's
                if self.args.strict:
                    raise
                result = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                self.say(f"{phase}: FAILED {result['error']}")
            result["phase_seconds"] = round(time.time() - t0, 1)
            self.result["phases"][phase] = result
            self.save()
        self.say(format_table(self.result))
        # A run once stopped here for minutes at TP=4 (after its results were saved): if that
        # recurs, print where every thread is and exit instead of hanging.
        faulthandler.dump_traceback_later(90, exit=True)
        dist.barrier()
        # That hang was inside destroy_process_group (TP=4, and TP=2 after the loop phase, with
        # FlashInfer already closed), while cudagraph trees still held graphs with NCCL kernels
        # in them: free those graphs, then FlashInfer's workspaces, then the group.
        torch._dynamo.reset()  # also shuts the cudagraph trees down
        self.compiled.clear()
        gc.collect()
        self.sync()
        backend = get_backend("flashinfer")
        if not isinstance(backend, str):
            backend.close()
        dist.destroy_process_group()


def dispatch_since(before: dict) -> dict:
    """arfusion.stats()["dispatch"] counts added since `before` (an earlier arfusion.stats())."""
    old = before["dispatch"]
    return {k: v - old.get(k, 0) for k, v in arfusion.stats()["dispatch"].items() if v != old.get(k, 0)}


def format_table(result: dict) -> str:
    m, ph = result["meta"], result["phases"]
    lines = [f"{m['model_type']} {m['layers']} layers, hidden {m['hidden']}, TP={m['world']}, {m['device']}, "
             f"torch {m['torch']}, transformers {m['transformers']}"]
    if "rows" in ph.get("decode", {}):
        lines.append(f"{'decode step':<22} {'off ms':>9} {'on ms':>9} {'gain':>7} {'on tok/s':>10}")
        for r in ph["decode"]["rows"]:
            lines.append(f"{'batch ' + str(r['batch']):<22} {r['off_ms']:9.3f} {r['on_ms']:9.3f} "
                         f"{r['gain_pct']:6.1f}% {r['on_tokens_per_s']:10.1f}")
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
    if "off_ms_per_token" in ph.get("loop", {}):
        lp = ph["loop"]
        lines.append(f"{lp['mode']} loop: off {lp['off_ms_per_token']} ms/token, on {lp['on_ms_per_token']} ms/token")
    if "off" in ph.get("generate", {}):
        g = ph["generate"]
        lines.append(f"generate(): off {g['off']['ms_per_token']} ms/token, on {g['on']['ms_per_token']} ms/token "
                     f"({g['on']['fused_sites']} sites fused in its graph)")
    for name, p in ph.items():
        if "error" in p or "skipped" in p:
            lines.append(f"{name}: {p.get('error') or p.get('skipped')}")
    return "\n".join(lines)


def plot(paths, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [d for d in (json.load(open(p)) for p in paths) if "rows" in d["phases"].get("decode", {})]
    if not data:
        raise SystemExit("no decode rows in " + ", ".join(paths))
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
    ax_acc.axhline(2e-2, color="red", lw=0.8, ls=":", label="issue target 2e-2")
    ax_acc.set(yscale="log", xlabel="teacher-forced step", ylabel="logits relative L2", title="accuracy")
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv=None):
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="llama", choices=sorted(PRESETS))
    p.add_argument("--tiny", action="store_true", help="a tiny config (hidden 256, 2 layers): CPU/CI")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA exists")
    p.add_argument("--layers", type=int, default=0, help="override the number of layers")
    p.add_argument("--rank-of", type=int, default=1, metavar="N",
                   help="one process, no TP: the model holds one rank's share of TP=N (heads, intermediates, "
                        "vocabulary divided by N), so its step is the TP=N step without communication")
    p.add_argument("--backend", default="auto", choices=["auto", "flashinfer", "aiter", "torch"])
    p.add_argument("--init", default="hf", choices=["hf", "scaled"],
                   help="random weights: HF's init (std 0.02), or with the residual branches' output "
                        "projections scaled by 1/sqrt(2 * layers) (GPT-2's init, closer to trained models)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--quantized", choices=QUANTIZED_LEVELS,
                   help="prefill also with the pass and this quantized all-reduce (fp8 on FlashInfer)")
    p.add_argument("--prompt", type=int, default=32, help="context tokens before the decode steps")
    p.add_argument("--steps", type=int, default=32, help="teacher-forced steps; also loop/generate tokens")
    p.add_argument("--replays", type=int, default=100, help="CUDA-graph replays per decode measurement")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--loop-order", nargs=2, default=list(CONFIGS), choices=CONFIGS,
                   help="which config the loop phase runs first (at TP=4 the fused loop run after the unfused "
                        "one in the same process was as slow as it: docs/benchmarks.md, 'Host-bound loops')")
    p.add_argument("--budget-s", type=float, default=0, help="skip phases that would start after this many seconds")
    p.add_argument("--strict", action="store_true", help="raise on a failing phase (tests)")
    p.add_argument("--ckpt-dir", default=None, help="where random checkpoints are written (default: temp dir)")
    p.add_argument("--cache-root", default=None, help="where the fresh Inductor cache dirs go (default: temp dir)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--tag", default="", help="suffix of the JSON file name (runs of some phases each)")
    p.add_argument("--plot", nargs="+", help="decode_*.json files to plot instead of measuring")
    p.add_argument("--png", default="bench_hf_decode.png")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.argv = argv
    if args.rank_of > 1 and int(os.environ.get("WORLD_SIZE", 1)) != 1:
        p.error("--rank-of runs one rank's share alone: start it with --nproc-per-node 1")
    if args.plot:
        plot(args.plot, args.png)
        return
    if args.tiny:
        args.prefill = [p for p in args.prefill if p <= 64] or [16, 64]
    if args.quantized:  # never NVLink multicast (NCCL NVLS, torch symmetric memory): as .device/setup.sh
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    Bench(args).run()


if __name__ == "__main__":
    main()
