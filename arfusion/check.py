"""`arfusion check`: what the pass fuses in a Hugging Face model, on a CPU, in one process.

    arfusion check llama                      # transformers' LlamaConfig defaults
    arfusion check /path/to/model --tp 4      # a local directory with a config.json
    arfusion check qwen3_moe --tokens 1,8 --quant fp8-dynamic

Two decoder layers at the model's real widths (kept so that a model with several kinds of
layer keeps two kinds), loaded with the model's tensor-parallel plan over a fake process group
of `--tp` ranks (torch's fake backend: no peers, no GPU, graphs as on GPUs), compiled with the
pass for each token count; one row per all-reduce and a one-line verdict. No weights are read
or downloaded: parameters hold the means of transformers' init distributions (zeros for most;
cheap at any width), and the pass judges every region on probe values of its own.

Also what `benchmarks/coverage/hf_coverage.py` builds its models with: `architectures`,
`save_random_model`, `load_tp_model`. transformers is imported inside the functions (`import arfusion` does not).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from .hf import experts_need_expert_parallel, prepare_for_compile, tp_kwargs
from .hf.loading import EXPERT_COUNTS
from .hf.configs import LAYERS, keep_layers
from .testing import FusionReport, fake_world, fusion_report
from .tuning import Progress

TOKENS = (1, 8)


class CheckError(Exception):
    """Bad input: printed as one line, exit code 2."""


# ----------------------------------------------------------------------------- which models
def architectures() -> list[tuple[str, str | None]]:
    """(model type, why it is skipped or None) for every causal-LM model type with a TP plan,
    plus those with only an expert-parallel plan (a row saying so)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except KeyError:
            continue
        if getattr(config_cls, "base_model_tp_plan", None):
            out.append((model_type, None))
        elif getattr(config_cls, "base_model_ep_plan", None):
            out.append((model_type, "expert-parallel plan only (no base_model_tp_plan)"))
    return out


def _with_tp_plan(config):
    """The config itself, or the text config of a composite one (Gemma-3's, Llama-4's) where
    only that has a TP plan."""
    for candidate in (config, config.get_text_config()):
        if getattr(type(candidate), "base_model_tp_plan", None):
            return candidate
    raise CheckError(f"model type '{config.model_type}' has no tensor-parallel plan in transformers "
                     f"(base_model_tp_plan is empty): loading it with tp_plan=\"auto\" shards nothing")


def two_layer_config(spec: str):
    """(config cut to 2 layers, the model type, how many layers the model has) for a model type
    (its config class's defaults) or a local directory with a config.json. Never downloads."""
    from transformers import AutoConfig

    if os.sep in spec or os.path.exists(spec):
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise CheckError(f"{spec}: no config.json in it" if path.is_dir() else f"{spec}: not a directory")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise CheckError(f"{spec}/config.json: {one_line(e)}") from e
    else:
        try:
            config = AutoConfig.for_model(spec)
        except ValueError as e:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            near = difflib.get_close_matches(spec, list(CONFIG_MAPPING.keys()), n=3)
            raise CheckError(f"unknown model type '{spec}' (not a directory either)"
                             + (f"; did you mean {', '.join(near)}?" if near else "")) from e
    config = _with_tp_plan(config)
    d = config.to_dict()
    layers = d.get("num_hidden_layers") or d.get("num_layers") or d.get("n_layer")
    d = keep_layers(d)
    model_type = d.pop("model_type")
    d.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **d), model_type, layers


def causal_lm_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise CheckError(f"model type '{config.model_type}' has no causal-LM class in transformers") from None


# ----------------------------------------------------------------------------- TP size
# Widths the TP plan splits into equal slices, one per rank: attention heads, key/value heads and
# each expert's intermediate size, or the routed experts' count where expert parallelism over the
# TP ranks shards them instead (transformers >= 5.25, `tp_kwargs`). `--tp` must divide them.
# transformers splits other widths unevenly (a dense MLP's, the vocabulary's), and those run. A "colwise" projection has its
# output sharded, as transformers' `get_kv_heads_per_rank` reads the plan.
QUERY_PROJECTIONS = ("q_proj", "q_b_proj", "q_gate_proj", "qkv_proj", "query_key_value")
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
EXPERT_WIDTHS = ("moe_intermediate_size", "expert_ffn_hidden_size", "intermediate_size")


def _sharded_widths(config) -> list[tuple[str, str]]:
    """(what, config attribute) of each width that the TP plan of `config` must split evenly."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    colwise = {key.rsplit(".", 1)[-1] for key, style in plan.items() if style == "colwise"}
    widths = []
    if colwise & set(QUERY_PROJECTIONS):
        widths.append(("attention heads", "num_attention_heads"))
    if colwise & set(KEY_PROJECTIONS):
        widths.append(("key/value heads", "num_key_value_heads"))
    count = next((a for a in EXPERT_COUNTS if isinstance(getattr(config, a, None), int) and getattr(config, a) > 0), None)
    if count and any("experts" in key.split(".") and style.startswith(("colwise", "rowwise", "packed_"))
                     for key, style in plan.items()):
        width = next((a for a in EXPERT_WIDTHS if getattr(config, a, None)), "")
        widths.append(("experts' intermediate size", width))
    elif count and experts_need_expert_parallel(config):  # loaded with ep_size = the TP size (tp_kwargs)
        widths.append(("routed experts", count))
    return widths


def check_tp_size(config, model_type: str, tp: int) -> None:
    """CheckError naming the first width that the TP plan shards and `tp` does not divide: one
    line before loading, where compiling would fail on a shape deep in Dynamo."""
    values = []  # (what, attribute, width); a per-layer list gives one per layer
    for what, attr in _sharded_widths(config):
        value = getattr(config, attr, None)
        values += [(what, attr, v) for v in (value if isinstance(value, list) else [value])
                   if isinstance(v, int) and v > 0]
    bad = next((value for value in values if value[2] % tp), None)
    if bad is None:
        return
    what, attr, width = bad
    if what == "routed experts":
        said = f"{width} {what} ({attr}) do not split over TP={tp} (expert parallelism over the TP ranks shards them)"
    elif not what.endswith("heads"):
        said = f"the {what}, {width} ({attr}), does not split over TP={tp} (the TP plan shards it)"
    elif width == 1:
        said = f"1 {what[:-1]} ({attr}) does not split over TP={tp} (the TP plan shards it)"
    else:
        said = f"{width} {what} ({attr}) do not split over TP={tp} (the TP plan shards them)"
    every = math.gcd(*(v for _, _, v in values))
    fits = [str(n) for n in range(2, 17) if every % n == 0]
    if fits:
        said += f"; --tp {' or '.join(filter(None, [', '.join(fits[:-1]), fits[-1]]))} would fit"
    raise CheckError(f"{model_type}: {said}")


# ----------------------------------------------------------------------------- loading
_RANDOM_INITS = {"normal_": lambda t, mean=0.0, std=1.0, **_: mean, "trunc_normal_": lambda t, mean=0.0, **_: mean,
                 "uniform_": lambda t, a=0.0, b=1.0, **_: (a + b) / 2}
for _name in ("xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"):
    _RANDOM_INITS[_name] = lambda t, *a, **k: 0.0


@contextlib.contextmanager
def _init_by_fill() -> Iterator[None]:
    """transformers' random initialisers fill each tensor with their distribution's mean instead
    (seconds at 8B widths, where drawing the numbers takes a minute on 2 cores). Where the
    installed transformers keeps them elsewhere, they draw as usual (slower, same result)."""
    try:
        from transformers.initialization import TORCH_INIT_FUNCTIONS as table
    except ImportError:
        yield
        return

    def filler(value_of):
        def fill(tensor, *args, **kwargs):
            with torch.no_grad():
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                local.fill_(value_of(tensor, *args, **kwargs))
            return tensor
        return fill

    saved = {k: table[k] for k in _RANDOM_INITS if k in table}
    table.update({k: filler(_RANDOM_INITS[k]) for k in saved})
    try:
        yield
    finally:
        table.update(saved)


def save_random_model(config, path: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """Writes a checkpoint of `config` with transformers' random init (seeded) into `path` (a
    directory), for `load_tp_model` to load on every rank; returns `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    return path


def load_tp_model(source: Any, tp: int | None = None, dtype: torch.dtype = torch.bfloat16):
    """A causal LM loaded tensor-parallel (its "auto" plan) over the current process group, in
    eval mode, ready to compile (`arfusion.hf.prepare_for_compile`): `source` a checkpoint
    directory (its weights), or a config (no weights read: the means of the init distributions;
    any tensor left unset holding a non-finite value is zeroed). `tp`: the TP size (None:
    WORLD_SIZE's, as under torchrun)."""
    from transformers import AutoModelForCausalLM

    tp_load = tp_kwargs("auto", config=source, tp_size=tp)  # experts by expert parallelism where the plan wants it
    if isinstance(source, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **tp_load).eval()
    else:
        with _init_by_fill():
            model = causal_lm_class(source).from_pretrained(None, config=source, state_dict={}, dtype=dtype,
                                                            **tp_load).eval()
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                local = t.to_local() if hasattr(t, "to_local") else t
                if local.is_floating_point() and not torch.isfinite(local.sum()):  # a sum: no copy of the tensor
                    local.zero_()
    prepare_for_compile(model)  # graph breaks in transformers' code: q/k-norm hooks (<= 5.17), looped experts
    return model


# ----------------------------------------------------------------------------- FP8 activation quant
# In front of the linears that read a norm, spelled as FP8 checkpoints and torchao spell it, then
# dequantized so the matmul runs anywhere (a real FP8 model would hand the FP8 tensor and scale
# to an FP8 matmul; the quant is what arfusion fuses either way).
FP8 = torch.float8_e4m3fn
NORM_READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
QUANTS = ("fp8-static", "fp8-dynamic", "fp8-group")


def fp8_static(x, scale):
    return (x / scale).clamp(-448, 448).to(FP8).to(x.dtype) * scale.to(x.dtype)


def fp8_dynamic(x):  # torchao's per-row spelling (Float8DynamicActivationFloat8WeightConfig, PerRow)
    scale = (x.abs().amax(dim=x.dim() - 1, keepdim=True) / 448.0).to(torch.float32)
    return ((x.to(torch.float32) / scale).clamp(-448.0, 448.0).to(FP8).to(torch.float32) * scale).to(x.dtype)


def fp8_group(x, group=128):
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (g / scale).clamp(-448, 448).to(FP8).reshape(x.shape)
    # Consumed as an FP8 GEMM reads it: [T, H] values with [T, H / 128] scales.
    return (q.float() * scale.squeeze(-1).repeat_interleave(group, dim=-1)).to(x.dtype)


def add_activation_quant(model, mode: str) -> int:
    """One quantizer per norm output: q/k/v (and gate/up) of a layer share its static scale.
    Returns how many linears got one."""
    scales, hooked = {}, 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in NORM_READERS:
            continue
        block = name.rsplit(".", 2)[0]  # layers.i.self_attn.q_proj -> layers.i
        scale = scales.setdefault(block + name.split(".")[-2], torch.tensor(0.05, device=module.weight.device))
        quantize = {"fp8-static": lambda x, s=scale: fp8_static(x, s), "fp8-dynamic": fp8_dynamic,
                    "fp8-group": fp8_group}[mode]
        module.register_forward_pre_hook(lambda mod, args, q=quantize: (q(args[0]), *args[1:]))
        hooked += 1
    return hooked


# ----------------------------------------------------------------------------- the command
def one_line(e: BaseException) -> str:
    """An exception as one line of at most 300 characters."""
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def _tokens_word(n: int) -> str:
    return f"{n} token" + "s" * (n != 1)


def check(spec: str, tp: int = 2, tokens=TOKENS, quant: str | None = None,
          show_progress: bool = True) -> tuple[str, list[tuple[int, FusionReport]]]:
    """(a header line, [(token count, report)]) for `arfusion check`; CheckError on bad input."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config, model_type, layers = two_layer_config(spec)
    check_tp_size(config, model_type, tp)
    text = config.get_text_config()
    progress = Progress(1 + len(tokens), f"arfusion check {model_type}", enabled=show_progress)
    reports = []
    try:
        # Dynamo's and Inductor's warnings about transformers' code are not the user's to act on.
        with fake_world(tp), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model = load_tp_model(config, tp)
            except CheckError:
                raise
            except Exception as e:
                raise CheckError(f"{model_type} does not load with its TP plan at TP={tp}: {one_line(e)}") from e
            if quant:
                add_activation_quant(model, quant)
            progress.update("loaded")
            header = (f"{model_type} ({type(model).__name__}): {LAYERS} of {layers} layers, hidden "
                      f"{text.hidden_size}, TP={tp} over a fake process group, bf16"
                      + (f", {quant} activation quant" if quant else "")
                      + (f"; experts sharded by expert parallelism over the {tp} ranks, as "
                         "arfusion.hf.tp_kwargs(\"auto\", config=path) loads them" if experts_need_expert_parallel(config)
                         else ""))
            generator = torch.Generator().manual_seed(0)
            for n in tokens:
                ids = torch.randint(0, text.vocab_size, (1, n), generator=generator).to(model.device)
                report = fusion_report(model, {"input_ids": ids, "use_cache": False})
                report.title, report.output = f"{_tokens_word(n)}:", None
                reports.append((n, report))
                progress.update(f"{_tokens_word(n)} compiled")
    finally:
        progress.close()
    return header, reports


def verdict(model_type: str, reports: list[tuple[int, FusionReport]]) -> str:
    """One line for every token count: the same words where they agree."""
    verdicts = {r.verdict for _, r in reports}
    if len(verdicts) == 1:
        counts = [str(n) for n, _ in reports]
        at = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " and " + counts[-1]
        return f"{model_type}: {verdicts.pop()} (at {at} token{'s' * (counts != ['1'])})"
    return f"{model_type}: " + "; ".join(f"at {_tokens_word(n)}: {r.verdict}" for n, r in reports)


def _unwritable(path: Path) -> str | None:
    """Why `path` cannot be written, said before minutes of compiling."""
    if path.is_dir():
        return "is a directory"
    if not path.parent.is_dir():
        return f"no directory {path.parent}"
    if not os.access(path.parent, os.W_OK):
        return f"cannot write in {path.parent}"
    return None


def main(args) -> int:
    """`arfusion check` (argparse namespace: model, tp, tokens, quant, json, quiet)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model type or a local directory: nothing to fetch
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        if not tokens or min(tokens) < 1:
            raise ValueError
    except ValueError:
        print(f"arfusion check: --tokens takes token counts like 1,8, not {args.tokens!r}", file=sys.stderr)
        return 2
    if args.tp < 2:
        print(f"arfusion check: --tp must be at least 2 (got {args.tp}): one rank has no all-reduce", file=sys.stderr)
        return 2
    problem = args.json and _unwritable(Path(args.json))
    if problem:
        print(f"arfusion check: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        header, reports = check(args.model, args.tp, tokens, args.quant, show_progress=not args.quiet)
    except CheckError as e:
        print(f"arfusion check: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the model loaded, then compiling or running it failed: a bug to report
        traceback.print_exc()
        print(f"arfusion check: {args.model} failed after loading: {one_line(e)}", file=sys.stderr)
        return 1
    print(header)
    for _, report in reports:
        print(f"\n{report}")
    model_type = header.split(" ", 1)[0]
    line = verdict(model_type, reports)
    print(f"\n{line}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "model_type": model_type, "header": header, "verdict": line,
            "seconds": round(time.perf_counter() - started, 1),
            "reports": [{"tokens": n, **r.to_dict()} for n, r in reports]}, indent=1) + "\n")
    return 0
