"""Train a small Llama-family decoder on Python's standard-library sources, for the accuracy harness.

    python benchmarks/train_tiny_llama.py --out ckpt/            # default: hidden 1024, 8 layers, vocab 8192 (one GPU, minutes)
    python benchmarks/train_tiny_llama.py --tiny --out /tmp/ck   # CPU, well under 2 minutes

The text exists on every machine: the `*.py` files under `sysconfig.get_paths()["stdlib"]`
(site-/dist-packages excluded), split deterministically by a hash of each file's path relative
to that directory: a file is held out iff `sha256(relpath) % 100 < --heldout-pct` (5 by
default). Different Python versions hold different files, so the held-out set is the one of the
Python that runs the script; `heldout_split()` is shared with `eval_accuracy.py`.

Tokenizer: a byte-level BPE trained with the `tokenizers` package on the training files (no
network), saved as `tokenizer.json` through `PreTrainedTokenizerFast`, so `AutoTokenizer`
loads it. Model: `LlamaForCausalLM`, trained in fp32 with bf16 autocast on CUDA (fp32 on CPU),
saved with `save_pretrained` in bf16 (the weights the bf16 configurations of the harness run;
its fp32 reference runs the same bf16 weights upcast). `train_meta.json` beside it records the
split, the data sizes, the held-out loss before and after training and the loss history.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

import torch

from common import save_json

EOS = "<|endoftext|>"


def stdlib_files(root: str | None = None) -> tuple[str, list[str]]:
    """(root, sorted relative paths of the standard library's *.py files)."""
    root = root or sysconfig.get_paths()["stdlib"]
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                rels.append(os.path.relpath(os.path.join(dirpath, name), root))
    return root, sorted(rels)


def file_hash(rel: str) -> int:
    return int(hashlib.sha256(rel.replace(os.sep, "/").encode()).hexdigest()[:16], 16)


def heldout_split(root: str | None = None, heldout_pct: int = 5) -> tuple[str, list[str], list[str]]:
    """(root, train files, held-out files): held out iff the path's hash % 100 < heldout_pct.
    Both lists are ordered by hash (a deterministic shuffle), so a byte budget takes a fixed subset."""
    root, rels = stdlib_files(root)
    rels = sorted(rels, key=lambda r: (file_hash(r), r))
    held = [r for r in rels if file_hash(r) % 100 < heldout_pct]
    train = [r for r in rels if file_hash(r) % 100 >= heldout_pct]
    return root, train, held


def read_texts(root: str, rels: list[str], max_bytes: int = 0) -> list[str]:
    texts, total = [], 0
    for rel in rels:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if max_bytes and total + len(text) > max_bytes:
            if total:
                break
            text = text[:max_bytes]
        texts.append(text)
        total += len(text)
    return texts


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """One long token stream: each file's tokens followed by EOS."""
    eos = tokenizer.convert_tokens_to_ids(EOS) if EOS in tokenizer.get_vocab() else tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int, count: int = 0) -> torch.Tensor:
    """Non-overlapping [n, seq_len] windows from the start of the stream (the last partial one dropped)."""
    n = stream.numel() // seq_len
    if count:
        n = min(n, count)
    return stream[: n * seq_len].view(n, seq_len)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, unk_token=EOS)


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, batch: int, device, amp: bool) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch):
        x = data[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(),
                                                 reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory (HF save_pretrained)")
    p.add_argument("--tiny", action="store_true", help="tiny model and data: CPU, under 2 minutes on 2 cores")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--heldout-pct", type=int, default=5)
    p.add_argument("--heldout-seqs", type=int, default=64, help="held-out windows for the loss before/after")
    p.add_argument("--max-train-bytes", type=int, default=0, help="0: every training file")
    p.add_argument("--tokenizer-bytes", type=int, default=20_000_000, help="text the BPE is trained on")
    p.add_argument("--time-budget-s", type=float, default=0, help="stop training after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:  # every size small; explicit flags after --tiny do not apply (keep it simple)
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 128, 2, 4, 4, 256
        args.vocab, args.seq_len, args.batch, args.steps, args.lr, args.warmup = 512, 64, 8, 60, 3e-3, 5
        args.heldout_seqs, args.max_train_bytes, args.tokenizer_bytes = 16, 300_000, 300_000

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    t_start = time.time()

    root, train_files, held_files = heldout_split(heldout_pct=args.heldout_pct)
    train_texts = read_texts(root, train_files, args.max_train_bytes)
    held_texts = read_texts(root, held_files, max(args.heldout_seqs * args.seq_len * 8, 200_000))
    tok_texts = read_texts(root, train_files, args.tokenizer_bytes)
    tokenizer = train_tokenizer(tok_texts, args.vocab)
    train_ids = encode_stream(tokenizer, train_texts)
    held = windows(encode_stream(tokenizer, held_texts), args.seq_len, args.heldout_seqs)
    data = windows(train_ids, args.seq_len)
    print(f"stdlib {root}: {len(train_files)} train / {len(held_files)} held-out files; "
          f"{train_ids.numel()} train tokens ({data.shape[0]} windows), {held.shape[0]} held-out windows of "
          f"{args.seq_len}; vocab {len(tokenizer)}; {time.time() - t_start:.1f} s", flush=True)

    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                         vocab_size=len(tokenizer), max_position_embeddings=max(2048, args.seq_len),
                         tie_word_embeddings=False, rope_theta=10000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(device)
    with torch.no_grad():  # GPT-2's residual init: each layer a small update of the stream
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_((2 * args.layers) ** -0.5)
    n_params = sum(p.numel() for p in model.parameters())
    amp = cuda
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=cuda or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))))  # warmup, cosine to 10%
    loss_before = heldout_loss(model, held, args.batch, device, amp)
    print(f"{n_params / 1e6:.1f}M parameters; held-out loss before training {loss_before:.4f}", flush=True)

    g = torch.Generator().manual_seed(args.seed)
    history, step, t0 = [], 0, time.time()
    model.train()
    done = False
    while not done:
        for idx in torch.randperm(data.shape[0], generator=g).split(args.batch):
            if step >= args.steps or (args.time_budget_s and time.time() - t0 > args.time_budget_s):
                done = True
                break
            if idx.numel() < args.batch:
                continue
            x = data[idx].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % max(1, args.steps // 20) == 0 or step == 1:
                history.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - t0, 1)})
                print(f"step {step}: loss {loss.item():.4f} ({time.time() - t0:.1f} s)", flush=True)
    steps_done = step
    train_s = time.time() - t0
    loss_after = heldout_loss(model, held, args.batch, device, amp)
    print(f"held-out loss {loss_before:.4f} -> {loss_after:.4f} (ppl {math.exp(loss_after):.2f}) after "
          f"{steps_done} steps, {train_s:.1f} s", flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    meta = {
        "text": "python stdlib *.py", "stdlib": root, "python": sys.version.split()[0],
        "heldout_pct": args.heldout_pct, "train_files": len(train_files), "heldout_files": len(held_files),
        "train_tokens": int(train_ids.numel()), "seq_len": args.seq_len, "batch": args.batch,
        "steps": steps_done, "lr": args.lr, "params_m": round(n_params / 1e6, 2), "vocab": len(tokenizer),
        "hidden": args.hidden, "layers": args.layers, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "heldout_windows": int(held.shape[0]),
        "heldout_loss_before": round(loss_before, 4), "heldout_loss_after": round(loss_after, 4),
        "heldout_ppl_after": round(math.exp(loss_after), 3), "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1), "history": history,
        "command": "python benchmarks/train_tiny_llama.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    save_json(os.path.join(args.out, "train_meta.json"), meta)
    print(json.dumps({k: v for k, v in meta.items() if k != "history"}), flush=True)


if __name__ == "__main__":
    main()
