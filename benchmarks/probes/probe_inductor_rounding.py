"""Which roundings does Inductor keep in `residual + x -> HF Llama RMSNorm` (bf16)? Not collected by pytest.

    python benchmarks/probes/probe_inductor_rounding.py [--device cuda|cpu]

The model as written rounds the residual sum to bf16, normalises it in fp32, rounds the normalised
value to bf16 and rounds again after the weight. Fused all-reduce kernels (FlashInfer's
allreduce_fusion) round the sum and the output once each. With `emulate_precision_casts=False`
(Inductor's default) a fused kernel may skip roundings that the graph spells as casts. This
compiles the chain and counts, for each of the four ways to round (sum rounded or not, normalised
value rounded or not), the elements where the compiled output differs: the variant with (almost)
no differences is what Inductor computes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch


def chain(residual, x, weight):
    h = residual + x
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * normed.to(torch.bfloat16), h


def variant(residual, x, weight, sum_rounded: bool, normed_rounded: bool):
    bf16 = torch.bfloat16
    hf = residual.float() + x.float()
    if sum_rounded:
        hf = hf.to(bf16).float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    if normed_rounded:
        normed = normed.to(bf16).float()
    return (weight.float() * normed).to(bf16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    torch.manual_seed(0)
    dev, bf16 = torch.device(args.device), torch.bfloat16
    residual = torch.randn(args.tokens, args.hidden, dtype=bf16, device=dev)
    x = (0.1 * torch.randn(args.tokens, args.hidden, device=dev)).to(bf16)
    weight = (1 + 0.1 * torch.randn(args.hidden, device=dev)).to(bf16)
    compiled, _ = torch.compile(chain)(residual, x, weight)
    eager, _ = chain(residual, x, weight)
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "elements": compiled.numel(),
              "emulate_precision_casts": torch._inductor.config.emulate_precision_casts,
              "compiled_vs_eager": int((compiled != eager).sum())}
    for sum_rounded in (True, False):
        for normed_rounded in (True, False):
            key = f"sum {'rounded' if sum_rounded else 'fp32'}, normed {'rounded' if normed_rounded else 'fp32'}"
            result[key] = int((compiled != variant(residual, x, weight, sum_rounded, normed_rounded)).sum())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
