"""How far apart do one-ulp bf16 differences push a random Llama-3-8B-shape model's logits?

    python benchmarks/hf_rounding_sensitivity.py [--fraction 0.0039] [--layers 32]

Single process, CPU is enough (16 GB of memory for the 8B shape). After every decoder layer the
last mantissa bit of a random fraction of the residual stream's elements is flipped (one bf16
step, as two implementations that round one addition differently produce), and the logits of
16 random tokens are compared with the unperturbed forward: the noise floor that fused-vs-unfused
comparisons on random weights (bench_hf_decode.py's accuracy phase) cannot go below.

    python benchmarks/hf_rounding_sensitivity.py --perturb norm-rounding

instead computes every RMSNorm as FlashInfer's fused kernel does, `bf16(h * rsqrt(var + eps) * w)`
with one rounding, where HF rounds the normalized value to bf16 before multiplying by the weight
(two roundings): at TP=2 the only difference between the fused and the unfused graph's math
(both sum two ranks exactly and round once; the residual add rounds the same).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import rel_err_rows, top1_same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fraction", type=float, default=1 / 256, help="share of elements nudged per layer")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--perturb", choices=("nudge", "norm-rounding"), default="nudge")
    args = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=4096, num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
    started = time.time()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    print(f"built in {time.time() - started:.0f} s", flush=True)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    nudging = {"generator": None}

    def nudge(module, inputs, output):
        if nudging["generator"] is None:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        mask = torch.rand(hidden.shape, generator=nudging["generator"]) < args.fraction
        bits = hidden.view(torch.int16)
        nudged = torch.where(mask, bits ^ 1, bits).view(torch.bfloat16)
        return (nudged, *output[1:]) if isinstance(output, tuple) else nudged

    if args.perturb == "norm-rounding":
        single_rounding(model, ids)
        return
    for layer in model.model.layers:
        layer.register_forward_hook(nudge)
    with torch.no_grad():
        reference = model(ids).logits.float()
        for seed in range(1, args.seeds + 1):
            nudging["generator"] = torch.Generator().manual_seed(seed)
            logits = model(ids).logits.float()
            rel = rel_err_rows(logits, reference)[0]
            top1 = top1_same(logits, reference).mean().item()
            print(f"fraction {args.fraction:.2e}, seed {seed}: logits rel L2 max {rel.max():.2e}, "
                  f"median {rel.median():.2e}; top-1 agreement {100 * top1:.1f}%", flush=True)


def single_rounding(model, ids) -> None:
    """Logits with every RMSNorm rounded once (FlashInfer) vs twice (HF), and how many norm
    output elements the two roundings tell apart."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    counts = {"differ": 0, "total": 0}
    mode = {"single": False}

    def forward(self, h):
        hf = h.float()
        normalized = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        twice = self.weight * normalized.to(h.dtype)
        once = (normalized * self.weight.float()).to(h.dtype)
        counts["differ"] += (once != twice).sum().item()
        counts["total"] += once.numel()
        return once if mode["single"] else twice

    for norm in norms:
        norm.forward = forward.__get__(norm)
    with torch.no_grad():
        reference = model(ids).logits.float()
        mode["single"] = True
        counts.update(differ=0, total=0)
        logits = model(ids).logits.float()
    rel = rel_err_rows(logits, reference)[0]
    top1 = top1_same(logits, reference).mean().item()
    print(f"norm rounded once vs twice: {100 * counts['differ'] / counts['total']:.1f}% of norm outputs "
          f"differ; logits rel L2 max {rel.max():.2e}, median {rel.median():.2e}; "
          f"top-1 agreement {100 * top1:.1f}%", flush=True)


if __name__ == "__main__":
    main()
