"""bench_hf_decode.py's model and world: presets, configs, random checkpoints, and the `Bench`
state the phases share (the model, its compiles, caches, prompts, timing of one step)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch._dynamo.utils
import torch.distributed as dist

import arfusion
from arfusion.backends.flashinfer_dispatch import moe_finalize_opted_in
from arfusion.hf import prepare_for_compile, tp_kwargs
from common import floor_options, log_arfusion_info, save_json, sync

# Real models' shapes (random weights): Llama-3-8B, Llama-3-70B, Qwen3-8B, Gemma-7B, Qwen3-30B-A3B,
# DeepSeek-V2-Lite. A preset is named by its model type unless MODEL_TYPES says otherwise.
PRESETS = {
    "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # 80 layers are 141 GB of bf16 weights to write and load: --layers picks how many a run holds.
    "llama70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                     intermediate_size=28672, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=12288, vocab_size=151936, head_dim=128, max_position_embeddings=8192),
    "gemma": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=24576, vocab_size=256000, head_dim=256, max_position_embeddings=8192),
    # MoE: Qwen3-30B-A3B and DeepSeek-V2-Lite (use --layers to shorten them)
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
MODEL_TYPES = {"llama70b": "llama"}
CONFIGS = ("off", "on")


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
    if getattr(args, "unique_layers", 0):  # the checkpoint holds these; repeat_layers makes the rest
        shape["num_hidden_layers"] = args.unique_layers
    if args.rank_of > 1:
        shape = one_rank_shape(shape, args.rank_of)
    return AutoConfig.for_model(MODEL_TYPES.get(args.model_type, args.model_type), tie_word_embeddings=False, **shape)


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


def random_model(config, device, init: str = "hf"):
    """Random bf16 weights, initialised on `device` (fast on a GPU), the same for a given config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if init == "scaled":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if any(f".{proj}." in name for proj in RESIDUAL_OUTPUTS):
                    param.mul_((2 * config.num_hidden_layers) ** -0.5)
    return model


def _with_layer_index(module: torch.nn.Module, index: int) -> torch.nn.Module:
    """A shallow copy of `module` and its submodules: the same parameters, buffers and hooks (the
    TP plan's), its own `layer_idx` (the KV-cache layer it reads and writes)."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._modules = {name: _with_layer_index(child, index) for name, child in module._modules.items()}
    if hasattr(copy, "layer_idx"):
        copy.layer_idx = index
    return copy


def repeat_layers(model, total: int) -> None:
    """Make `model`'s decoder `total` layers deep by reusing its layers' weights in turn, each
    layer its own cache index: the work and memory traffic of a `total`-layer step from a
    checkpoint of the unique layers only, where a layer's weights outsize the GPU's L2 cache (a
    dense 70B layer: ~430 MB per GPU at TP=4; not an MoE layer at batch 1, which reads only its
    active experts, nor a model whose first layers differ, e.g. DeepSeek's dense ones)."""
    layers = model.model.layers
    unique = len(layers)
    model.model.layers = torch.nn.ModuleList(
        layers[i] if i < unique else _with_layer_index(layers[i % unique], i) for i in range(total))
    config = model.config
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i % unique] for i in range(total)]
    config.num_hidden_layers = total


def random_checkpoint(config, device, root: str | None, init: str = "hf") -> str:
    """Rank 0 writes random weights once per config; every rank then loads them tensor parallel.
    Reused when the same config was written before."""
    key = hashlib.sha256((config.to_json_string(use_diff=False) + init).encode()).hexdigest()[:12]
    path = os.path.join(root or tempfile.gettempdir(), f"arfusion-bench-{config.model_type}-{key}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "complete")):
        shutil.rmtree(path, ignore_errors=True)
        model = random_model(config, device, init)
        model.save_pretrained(path)
        open(os.path.join(path, "complete"), "w").close()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return path


def init_world(args, cuda: bool):
    """torchrun's world (NCCL on GPUs, gloo on CPU), or with --fake-world N one process standing
    for rank 0 of N through torch's fake process group: the TP=N model's shards load and compile
    as on a real rank, collectives return at once without computing (numbers wrong, host path real).
    With --nccl-host-path all-reduces run on a real one-rank group: that group (it counts them)."""
    if not args.fake_world:
        dist.init_process_group("nccl" if cuda else "gloo")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # transformers derives the TP size from WORLD_SIZE and the device from LOCAL_RANK.
    os.environ.update(WORLD_SIZE=str(args.fake_world), RANK="0", LOCAL_RANK="0")
    if getattr(args, "nccl_host_path", False):  # all-reduces on a real one-rank group (nccl_host_path.py)
        import nccl_host_path

        return nccl_host_path.init_world(args.fake_world, "nccl" if cuda else "gloo")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)


class Bench:
    """The model, its compiles and the helpers every phase uses; phases are in decode_phases.py
    and decode_host.py, and write into self.result["phases"]."""

    def __init__(self, args):
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.cpu
        if self.cuda:
            torch.cuda.set_device(0 if args.fake_world else int(os.environ.get("LOCAL_RANK", 0)))
        self.one_rank = init_world(args, self.cuda)
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
        self.compiled = {}
        if self.rank == 0:  # what the pass fused and declined, one line per graph
            log_arfusion_info()

    def say(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def out_of_time(self, needed_s: float = 0.0) -> bool:
        """Whether work of `needed_s` seconds, started now, would end past the budget (--budget-s).
        Rank 0 decides for every rank: ranks asking near the limit must not part ways (one in
        the collectives, the other skipping)."""
        if not self.args.budget_s:
            return False
        late = torch.tensor([float(time.time() + needed_s > self.started + self.args.budget_s)], device=self.device)
        dist.broadcast(late, 0)
        return bool(late.item())

    # ------------------------------------------------------------------ setup

    def load(self):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.config = model_config(self.args, self.world)
        t0 = time.perf_counter()
        # One process, no TP and no accuracy phase (which loads the checkpoint in fp32): the
        # same random weights straight from the config, without writing them to disk first.
        in_memory = self.world == 1 and "accuracy" not in self.args.phases
        if in_memory:
            self.model = random_model(self.config, self.device, self.args.init).eval()
        else:
            path = self.checkpoint = random_checkpoint(self.config, self.device, self.args.ckpt_dir, self.args.init)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **self.tp(path)).eval()
        if self.args.unique_layers:
            repeat_layers(self.model, self.args.layers)
            self.config = self.model.config
        prepare_for_compile(self.model)  # graph breaks in HF code: q/k norm hooks (<= 5.17), looped experts
        c, a = self.config, self.args
        command = (f"python benchmarks/bench_hf_decode.py {' '.join(a.argv)}" if a.fake_world else
                   f"torchrun --nproc-per-node {self.world} benchmarks/bench_hf_decode.py {' '.join(a.argv)}")
        self.result["meta"] = {
            "model_type": c.model_type, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
            "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "intermediate": c.intermediate_size, "vocab": c.vocab_size, "world": self.world,
            "fake_world": a.fake_world, "device": torch.cuda.get_device_name() if self.cuda else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "arfusion": arfusion.__version__, "flashinfer": flashinfer_version(), "backend": a.backend,
            "init": a.init, "rank_of": a.rank_of, "unique_layers": a.unique_layers,
            "weights": "in memory" if in_memory else "checkpoint, TP plan",
            "moe_finalize": moe_finalize_opted_in(),  # FlashInfer's MoE finalize kernel, opt-in
            "numa": getattr(a, "numa", None),  # the host's NUMA nodes, the GPU's, pinned or not (--pin-numa)
            "load_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": command}
        if a.fake_world:
            self.result["meta"]["fake_world_note"] = (
                f"one process holds rank 0's shards of TP={a.fake_world} (torch's fake process group): "
                "collectives return without computing, so numbers are wrong and times lack communication; "
                "graphs, CUDA-graph replays and kernel launches are the real host path"
                + ("; the fused op runs FlashInfer's host path and skips its kernel (a stand-in workspace)"
                   if getattr(a, "flashinfer_host_path", False) else "")
                + ("; every all-reduce runs NCCL's host path and kernel on a group of one rank "
                   "(benchmarks/nccl_host_path.py)" if getattr(a, "nccl_host_path", False) else ""))
        self.say(f"{c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, TP={self.world}"
                 f"{' (fake world)' if a.fake_world else ''} on {self.result['meta']['device']}, "
                 f"loaded in {self.result['meta']['load_s']} s")

    def tp(self, path) -> dict:
        """Tensor parallel over the ranks (MoE experts as tp_kwargs shards them), or nothing for
        --rank-of (one rank's share, no TP)."""
        return tp_kwargs("auto", config=path) if self.args.rank_of <= 1 else {"device_map": self.device}

    def compile(self, name: str, reduce_overhead: bool = False):
        """model compiled without ("off") or with ("on") the pass, or with it and the quantized
        all-reduce ("quantized"), or with every all-reduce dropped ("floor": the step without that
        communication, wrong numbers); per-compile options so they coexist in one process."""
        config = {"on": self.pass_config, "quantized": self.quantized_config}.get(name)
        options = dict(arfusion.inductor_options(config)) if config else floor_options() if name == "floor" else {}
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
        sync(self.device)

    def save(self):
        self.result["meta"]["seconds"] = round(time.time() - self.started)
        if self.one_rank is not None:
            self.result["meta"]["all_reduces_on_one_rank"] = self.one_rank.all_reduces
        if self.rank == 0 and self.args.out:
            tag = f"_{self.args.tag}" if self.args.tag else ""
            fake = f"_fake{self.args.fake_world}" if self.args.fake_world else ""
            name = f"decode_{self.config.model_type}_w{self.world}{fake}{tag}.json"
            save_json(os.path.join(self.args.out, name), self.result)

    # ------------------------------------------------------------------ timing one step

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


def flashinfer_version() -> str | None:
    """The installed FlashInfer's version (a wheel's metadata, or the module's own where it was
    unpacked without one), None where there is none."""
    import importlib.metadata
    import importlib.util

    for dist_name in ("flashinfer-python", "flashinfer"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        return getattr(__import__("flashinfer"), "__version__", None)
    except Exception:  # a broken install: the version is not worth failing the run for
        return None
