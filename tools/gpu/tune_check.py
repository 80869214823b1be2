#!/usr/bin/env python3
"""Checks `gpustitch tune` against the GPU: records a PyTorch memory snapshot of a training run
like bench/gpu/e2e/train_seqlen.py (a GPT trained with sequence lengths drawn per step), tunes it,
runs the same training again under the recommended PYTORCH_CUDA_ALLOC_CONF and compares the peak
reserved memory tune predicted with torch.cuda.max_memory_reserved(). Passes within --tolerance
(default 5%).

    python3 tools/gpu/tune_check.py --gpustitch build/tools/gpustitch --out /tmp/tune_check

Each training runs in its own process, so the allocator settings apply from the first allocation.
Writes OUT/snapshot.pickle, OUT/tune.json and OUT/result.json; exit status 0 on pass, 1 on fail.
"""
import argparse
import json
import os
import subprocess
import sys

TRAIN = r"""
import random, sys, torch, torch.nn as nn
steps, batch, seed, snapshot = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(seed); random.seed(seed)
if snapshot:
    torch.cuda.memory._record_memory_history(max_entries=200000)
d, layers, vocab = 768, 12, 32000
layer = nn.TransformerEncoderLayer(d, 12, 4 * d, batch_first=True, norm_first=True)
model = nn.Sequential(nn.Embedding(vocab, d), nn.TransformerEncoder(layer, layers),
                      nn.Linear(d, vocab)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(steps):
    seq = random.choice([256, 512, 1024, 2048, 4096])
    x = torch.randint(0, vocab, (batch, seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
if snapshot:
    torch.cuda.memory._dump_snapshot(snapshot)
print(torch.cuda.max_memory_reserved())
"""


def train(args, snapshot, conf):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    out = subprocess.run([sys.executable, "-c", TRAIN, str(args.steps), str(args.batch),
                          str(args.seed), snapshot], env=env, check=True, capture_output=True,
                         text=True).stdout
    return int(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpustitch", default="build/tools/gpustitch")
    p.add_argument("--out", default="tune_check")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity-gb", type=float, default=0,
                   help="capacity for tune (default: the device's total memory)")
    p.add_argument("--tolerance", type=float, default=0.05)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    snap = os.path.join(args.out, "snapshot.pickle")
    recorded_default = train(args, snap, "")
    capacity = args.capacity_gb
    if capacity <= 0:
        import torch
        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
    tuned = subprocess.run([args.gpustitch, "tune", snap, "--capacity-gb", f"{capacity:.3f}",
                            "--json"], check=True, capture_output=True, text=True).stdout
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        f.write(tuned)
    rep = json.loads(tuned)
    rec = rep["recommendation"]
    conf = rec["pytorch_cuda_alloc_conf"]
    predicted = rec["peak_reserved_bytes"]
    default_row = next(r for r in rep["settings"] if r["setting"] == "default")
    measured = train(args, "", conf)
    error = abs(measured - predicted) / measured
    result = {"recommended": conf, "predicted_peak_reserved": predicted,
              "measured_peak_reserved": measured, "relative_error": error,
              "default_predicted_peak_reserved": default_row["peak_reserved_bytes"],
              "default_measured_peak_reserved": recorded_default,
              "snapshot_truncated": rep.get("snapshot", {}).get("truncated"),
              "pass": error <= args.tolerance}
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
