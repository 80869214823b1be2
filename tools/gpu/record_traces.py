#!/usr/bin/env python3
"""Records small allocation traces of PyTorch training with dynamic sequence lengths, for the
replay tests and benchmarks (tests/data/traces/). Run on a GPU machine with PyTorch:

    python3 tools/gpu/record_traces.py --lib build/preload/libgpustitch.so \
        --out-dir tests/data/traces

Each workload runs in a child process with
    LD_PRELOAD=<lib>  PYTORCH_NO_CUDA_MEMORY_CACHING=1  GPUSTITCH_CONF=trace:<out>/<name>.csv
so every tensor allocation and free reaches gpustitch (PyTorch's cache is off) and is written in
RMM's CSV format. The script then checks each trace (header, every free matches an allocation,
size under --max-bytes) and prints one PASS/FAIL line per trace.
"""
import argparse
import csv
import os
import random
import subprocess
import sys

WORKLOADS = {
    # name: (layers, d_model, heads, batch, steps, sequence lengths, seed)
    "transformer_dynseq": (2, 256, 4, 8, 12, [64, 128, 256, 512, 1024, 2048], 1),
    "transformer_dynseq_long": (4, 384, 6, 4, 8, [128, 2048, 256, 4096, 512, 64], 2),
    "transformer_bucketed": (2, 256, 4, 8, 12, [512], 3),
}


def run_workload(name):
    import torch
    import torch.nn as nn

    layers, d_model, heads, batch, steps, lengths, seed = WORKLOADS[name]
    random.seed(seed)
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    vocab = 4096
    emb = nn.Embedding(vocab, d_model).to(dev)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, batch_first=True), layers
    ).to(dev)
    head = nn.Linear(d_model, vocab).to(dev)
    params = list(emb.parameters()) + list(enc.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    kept = []  # a few tensors outlive their step, as logging and caches do in real code
    for step in range(steps):
        seq = random.choice(lengths)
        ids = torch.randint(0, vocab, (batch, seq), device=dev)
        logits = head(enc(emb(ids)))
        loss = nn.functional.cross_entropy(logits.view(-1, vocab), ids.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kept.append(logits[:, -1].detach().clone())
        kept = kept[-3:]
        torch.cuda.synchronize()
        print(f"{name}: step {step} seq {seq} loss {loss.item():.3f}", flush=True)


def check_trace(path, max_bytes):
    size = os.path.getsize(path)
    live = {}
    allocs = frees = unmatched = 0
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows)
        if header[:6] != ["Thread", "Time", "Action", "Pointer", "Size", "Stream"]:
            return False, f"bad header {header}"
        for row in rows:
            action, ptr = row[2], row[3]
            if action == "allocate":
                allocs += 1
                live[ptr] = live.get(ptr, 0) + 1
            elif action == "free":
                frees += 1
                if live.get(ptr, 0) == 0:
                    unmatched += 1
                else:
                    live[ptr] -= 1
            else:
                return False, f"bad action {action}"
    detail = f"{size} bytes, {allocs} allocations, {frees} frees, {unmatched} unmatched frees"
    ok = allocs > 0 and unmatched == 0 and size <= max_bytes
    return ok, detail


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="path to libgpustitch.so")
    ap.add_argument("--out-dir", default="tests/data/traces")
    ap.add_argument("--max-bytes", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="*", help="workloads to record (default: all)")
    args = ap.parse_args()
    if args.run:
        run_workload(args.run)
        return 0
    if not args.lib or not os.path.exists(args.lib):
        print("FAIL: --lib must name the built libgpustitch.so")
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    failed = 0
    for name in args.only or WORKLOADS:
        out = os.path.abspath(os.path.join(args.out_dir, name + ".csv"))
        env = dict(os.environ)
        env["LD_PRELOAD"] = os.path.abspath(args.lib)
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        env["GPUSTITCH_CONF"] = "trace:" + out
        proc = subprocess.run([sys.executable, __file__, "--run", name], env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"FAIL {name}: workload exited {proc.returncode}")
            failed += 1
            continue
        ok, detail = check_trace(out, args.max_bytes)
        print(f"{'PASS' if ok else 'FAIL'} {name}: {out}: {detail}")
        failed += 0 if ok else 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
