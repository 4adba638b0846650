#!/usr/bin/env python3
"""Generates allocation traces of one pipeline stage of a fine-grained MoE model training step.

Each trace is a 1F1B schedule over micro-batches. A forward pass allocates, per layer, the
saved activations of attention and of a fine-grained MoE block whose per-expert tensors scale
with that expert's load factor r (tokens routed to it over the balanced count); about 3% of
micro-batches carry a 2.6x spike on the local experts. Backward frees them in reverse order,
with gradient temporaries. Parameters, gradients and optimizer state are allocated up front.

Output formats: RMM logging CSV (Thread,Time,Action,Pointer,Size,Stream) and PyTorch snapshot
JSON (device_traces). Deterministic (seeded). Run: python3 traces/gen_moe_traces.py
"""
import json
import os
import random

BF16, FP32 = 2, 4


class Trace:
    def __init__(self):
        self.events = []  # (action, ptr, size, stream)
        self.next_ptr = 0x7f0000000000
        self.live = {}

    def alloc(self, size, stream=0):
        size = max(1, int(size))
        ptr = self.next_ptr
        self.next_ptr += (size + 511) // 512 * 512 + 512  # fake, unique addresses
        self.events.append(("alloc", ptr, size, stream))
        self.live[ptr] = (size, stream)
        return ptr

    def free(self, ptr):
        size, stream = self.live.pop(ptr)
        self.events.append(("free", ptr, size, stream))


def gen(cfg, seed):
    rng = random.Random(seed)
    t = Trace()
    h, f, e_total, e_local, topk = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["local_experts"], cfg["topk"]
    tokens, layers, mbs, stages, rank = cfg["tokens"], cfg["layers"], cfg["micro_batches"], cfg["stages"], cfg["rank"]
    heads = cfg["heads"]
    # Persistent state: attention and expert weights (bf16), fp32 grads and Adam state.
    persistent = []
    for _ in range(layers):
        for size in (4 * h * h * BF16, e_local * 3 * h * f * BF16, h * e_total * FP32):
            persistent.append(t.alloc(size))
            persistent.append(t.alloc(size * 2))  # fp32 main grad
    balanced = tokens * topk / e_total

    def load_factors():
        spike = rng.random() < cfg["spike_prob"]
        rs = [max(0.2, rng.lognormvariate(0.0, cfg["imbalance"])) for _ in range(e_local)]
        if spike:
            rs = [r * cfg["spike"] for r in rs]
        return rs

    def forward(mb):
        saved = []
        rs = load_factors()
        for _ in range(layers):
            x = [t.alloc(tokens * h * BF16)]  # layernorm input
            x.append(t.alloc(tokens * 3 * h * BF16))  # qkv
            x.append(t.alloc(tokens * heads * FP32))  # softmax stats
            tmp = t.alloc(tokens * h * BF16 * 2)  # attention workspace
            x.append(t.alloc(tokens * h * BF16))  # attention out
            t.free(tmp)
            x.append(t.alloc(tokens * e_total * FP32))  # router logits
            # all-to-all dispatch buffers on the communication stream
            send = t.alloc(tokens * topk * h * BF16, stream=1)
            recv = t.alloc(sum(balanced * r for r in rs) * h * BF16, stream=1)
            t.free(send)
            for r in rs:
                n = balanced * r
                x.append(t.alloc(n * h * BF16))  # expert input
                x.append(t.alloc(n * 2 * f * BF16))  # gate/up
                x.append(t.alloc(n * f * BF16))  # activation
            out = t.alloc(tokens * topk * h * BF16, stream=1)
            t.free(recv)
            x.append(t.alloc(tokens * h * BF16))  # combined output
            t.free(out)
            saved.append(x)
        return saved, rs

    def backward(saved, rs):
        for x in reversed(saved):
            g = t.alloc(tokens * h * BF16)  # incoming grad
            for p in reversed(x):
                size = t.live[p][0]
                gt = t.alloc(size)  # grad of this activation
                t.free(p)
                t.free(gt)
            t.free(g)

    warmup = min(stages - rank - 1, mbs)
    inflight = []
    f_done = 0
    for _ in range(warmup):
        inflight.append(forward(f_done))
        f_done += 1
    while f_done < mbs:
        inflight.append(forward(f_done))
        f_done += 1
        backward(*inflight.pop(0))
    while inflight:
        backward(*inflight.pop(0))
    for p in persistent:
        t.free(p)
    return t.events


def peak_live(events):
    live = cur = 0
    sizes = {}
    for a, p, s, _ in events:
        if a == "alloc":
            cur += s
            sizes[p] = s
        else:
            cur -= sizes.pop(p)
        live = max(live, cur)
    return live


def write_csv(path, events):
    with open(path, "w") as out:
        out.write("Thread,Time,Action,Pointer,Size,Stream\n")
        for i, (a, p, s, st) in enumerate(events):
            out.write(f"0,{i},{'allocate' if a == 'alloc' else 'free'},0x{p:x},{s},{st}\n")


def write_json(path, events):
    trace = []
    for i, (a, p, s, st) in enumerate(events):
        actions = ["alloc"] if a == "alloc" else ["free_requested", "free_completed"]
        for act in actions:
            trace.append({"action": act, "addr": p, "size": s, "stream": st, "time_us": i})
    with open(path, "w") as out:
        json.dump({"segments": [], "device_traces": [trace]}, out, separators=(",", ":"))


# Fine-grained MoE stages, scaled down (tokens per micro-batch) to keep files small.
CONFIGS = {
    "moe-fine-64e": dict(hidden=2048, ffn=1408, experts=64, local_experts=8, topk=6, heads=16,
                         tokens=4096, layers=4, micro_batches=8, stages=4, rank=0,
                         imbalance=0.15, spike=2.6, spike_prob=0.03),
    "moe-spiky-128e": dict(hidden=2560, ffn=1536, experts=128, local_experts=16, topk=8, heads=20,
                           tokens=4096, layers=3, micro_batches=12, stages=4, rank=1,
                           imbalance=0.25, spike=2.6, spike_prob=0.15),
    "moe-coarse-16e": dict(hidden=4096, ffn=4096, experts=16, local_experts=2, topk=2, heads=32,
                           tokens=2048, layers=4, micro_batches=8, stages=2, rank=0,
                           imbalance=0.2, spike=2.6, spike_prob=0.05),
}

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        ev = gen(cfg, seed=1000 + i)
        write_csv(os.path.join(here, name + ".csv"), ev)
        print(f"{name}.csv: {len(ev)} events, peak live {peak_live(ev) / 2**30:.2f} GiB")
    ev = gen(CONFIGS["moe-fine-64e"], seed=7)
    write_json(os.path.join(here, "moe-fine-64e.snapshot.json"), ev)
    print(f"moe-fine-64e.snapshot.json: {len(ev)} events")
