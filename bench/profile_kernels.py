"""Per-kernel GPU times and launch resources of one attention forward+backward (run on the GPU).

For each provider ("flash" = our kernels with their default tiles, "flash-tma" / "flash-ptr" = our
backward with tensor-descriptor loads forced on / off in both kernels, "flex", "sdpa-flash",
"sdpa-cudnn") and each (d, N) of the benchmark's shapes (causal bf16, B·N = --tokens, H·d = --hidden),
it profiles a few forward+backward calls with torch.profiler and reports every CUDA
kernel: mean duration (µs), calls per step, registers per thread, shared memory, grid, block and the
profiler's estimated occupancy. Useful to see where a provider's backward time goes (which kernel,
how many registers, how many programs per SM) when the end-to-end numbers of `bench/attention.py`
differ. Timings here include profiler overhead: the benchmark, not this, is the reference for speed.

    python -m bench.profile_kernels --seqlens 4096,16384 --headdims 128 --json /tmp/profile.json
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import torch
import triton

from bench._gpu import parser, require_cuda
from bench.attention import build_provider
from bench.tune import shape_inputs
from kernels.tiles import override_tile_config

_ARGS = ("registers per thread", "shared memory", "grid", "block", "est. achieved occupancy %")


def profile_provider(fn, q, k, v, do, steps: int) -> list[dict]:
    """Kernel table of `steps` forward+backward calls of fn(q, k, v) (after two warm-up calls)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, dict] = defaultdict(lambda: dict(total_us=0.0, calls=0))
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = kernels[ev.name]
        row["total_us"] += ev.device_time
        row["calls"] += 1
    # resources are only in the chrome trace's event args
    path = f"/tmp/profile_kernels_{time.time_ns()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and ev.get("name") in kernels:
            args = ev.get("args", {})
            for key in _ARGS:
                if key in args:
                    kernels[ev["name"]][key] = args[key]
    out = []
    for name, row in kernels.items():
        row = dict(row, name=name, mean_us=row["total_us"] / row["calls"],
                   calls_per_step=row["calls"] / steps)
        out.append(row)
    out.sort(key=lambda r: -r["total_us"])
    return out


def main() -> None:
    p = parser("python -m bench.profile_kernels", __doc__)
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--headdims", default="128")
    p.add_argument("--providers", default="flash,flash-tma,flex,sdpa-flash,sdpa-cudnn")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the tables here")
    a = p.parse_args()
    require_cuda("python -m bench.profile_kernels")
    dev = torch.device("cuda")
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=[])
    for d in map(int, a.headdims.split(",")):
        for n in map(int, a.seqlens.split(",")):
            b, h, (q, k, v, do) = shape_inputs(a, n, d, dev)
            for name in a.providers.split(","):
                # flash: the shipped defaults (TileConfig.tma per kernel); flash-tma / flash-ptr force the
                # tensor-descriptor loads on / off in both backward kernels
                ours = name.startswith("flash")
                tma = {"-tma": True, "-ptr": False}.get(name[len("flash"):]) if ours else None
                fn = build_provider("flash" if ours else name, n=n, device=dev)
                with override_tile_config(tma=tma):
                    table = profile_provider(fn, q, k, v, do, a.steps)
                total = sum(r["total_us"] for r in table) / a.steps
                print(f"== {name} d={d} N={n} (B={b}, H={h}): {total:.0f} µs of kernels per fwd+bwd",
                      flush=True)
                for r in table:
                    res = " ".join(f"{key.split()[0]}={r[key]}" for key in _ARGS if key in r)
                    print(f"   {r['mean_us']:9.1f} µs x{r['calls_per_step']:.0f}  {r['name'][:70]:70s} {res}",
                          flush=True)
                result["rows"].append(dict(provider=name, d=d, N=n, B=b, H=h, kernels=table))
            del q, k, v, do
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
