"""GPU A/B on a third-party model (issue 27): a Hugging Face transformers Qwen3-MoE or DeepSeek-V3
config of a few hundred million parameters, bf16, one sequence of 4096-8192 tokens, one GPU,
one process. Arms (each its own copy of the same initial weights; one forward + backward per
step, no optimizer step, so every arm computes the same gradients):

    eager        the model as it is (the reference of the eager arms)
    eager_again  the same again: whether the model itself is run-to-run deterministic here
    save_on_cpu  eager under torch.autograd.graph.save_on_cpu(pin_memory=True)
    aot_eager    torch.compile(backend="aot_eager") (the reference of the compiled arms)
    compiled     torch.compile(backend="sched_lifetime"), paging off
    cudagraphs   torch.compile(backend="sched_lifetime", options={"cudagraphs": True}) (CUDA only)
    paging       torch.compile(backend="sched_lifetime", options={"paging": True}): default
                 paging options (timed: calibrated over the first two steps)
    paging_pycopy  the same, each page copy's CUDA calls made one by one from Python
                 (`PageStreams.native_copy = False`); the paging arm queues each copy with one
                 native call (the library's default)
    paging_gather  the same, a saved tensor with gaps (the halves of the experts' fused gate/up
                 projection) copied by torch's copy_, a gather (scatter) kernel and a device
                 temporary per copy (`PageStreams.pitched_copy = False`); the paging arm moves
                 it with one pitched copy on the copy engine (`paging/pitched.py`, the default)
    paging_b     the paging arm with `--paging-b` options over its own: two paging settings
                 A/B in one run (e.g. `--paging-b '{"paging_group_out": 4}'`)
    compiled_dma   compiled, with copies between device and pinned host memory queued on a side
                 stream at each step's start (`--dma-mib`, `--dma-dir`; none of the model's data,
                 nothing waits on them but the step's closing sync): does the copies' traffic
                 alone slow the host thread as the paged forward's host time is slowed?

Arms run one after another (torch._dynamo reset before each: arms compiled side by side share
dynamo's per-frame caches, which on these graph-broken models cost parity), the same batches in
each; steps 0 and 1 warm up (compile, calibrate) and are not timed; medians of the rest. Per arm: step time, the peak allocated above the step's start (not for
cudagraphs: its memory is the graph pool, held from capture on), and parity:
torch.equal on the loss and every gradient, every step, against eager (eager arms) and against
aot_eager (compiled arms: AOTAutograd's graphs are not bit-exact with eager in the gradients
on CPU, see tests/python/test_hf_models.py; eager vs aot_eager is printed too). Printed as a
table, each arm's time and peak as a ratio to the arm it is measured against (save_on_cpu:
eager; compiled: aot_eager; paging: compiled), and written as JSON to --out, with the compiled
arms' graph counts, the order pass's memory guard (graphs that kept AOTAutograd's order, the
highest scheduled/AOT estimated peak) and each pager's explanation.

    PYTHONPATH=torch_ops:HFDEPS python3 benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 5 --out OUT/hf.json
    PYTHONPATH=torch_ops:HFDEPS python3 benches/hf_paging_ab.py --tiny --out /tmp/hf_tiny.json     # CPU check

Determinism: strict by default (`torch.use_deterministic_algorithms(True)`): on an H200 the
attention's backward (cuDNN) is otherwise not run-to-run deterministic and no arm, not even
eager against itself, is bit-exact (`--determinism warn` shows it: the eager_again arm).

Targets (issue 27, GPU): `paging` saves >= 25% of `compiled`'s peak at <= 1.05x its step time,
and `compiled` is no slower than `aot_eager`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before the first cuBLAS call

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl  # noqa: E402,F401  (registers the backend)
from sched_lifetime import compile as slc  # noqa: E402
from sched_lifetime.paging.streams import PageStreams  # noqa: E402
from sched_lifetime.train.figures import union  # noqa: E402

#: A few hundred million parameters each (printed), bf16 on the GPU.
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, max_position_embeddings=16384)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=16384)),
}
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=128)
TINY_EXTRA = {
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}
ARMS = ("eager", "eager_again", "save_on_cpu", "aot_eager", "compiled", "cudagraphs", "paging", "paging_pycopy", "paging_gather", "paging_b", "compiled_dma")
REFERENCE = {"eager": "eager", "eager_again": "eager", "save_on_cpu": "eager", "aot_eager": "aot_eager", "compiled": "aot_eager", "cudagraphs": "aot_eager",
             "paging": "aot_eager", "paging_pycopy": "aot_eager", "paging_gather": "aot_eager", "paging_b": "aot_eager", "compiled_dma": "aot_eager"}



def overrides(text: str) -> dict:
    """`--set hidden_size=2048,moe_intermediate_size=1024`: config fields (ints, floats, or
    strings) over the model's defaults; a field the config class does not know is an error."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE[,KEY=VALUE...], got {item!r}")
        for conv in (int, float):
            try:
                out[key.strip()] = conv(val)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = val
    return out


def build(a: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    cfg_cls, model_cls, kw = CONFIGS[a.model]
    kw = {**kw, **TINY, **TINY_EXTRA[a.model]} if a.tiny else dict(kw)
    if a.experts:
        kw["experts_implementation"] = a.experts
    kw.update(a.set)
    default = getattr(transformers, cfg_cls)()  # a config takes unknown keys silently: check against its defaults
    unknown = sorted(k for k in a.set if not hasattr(default, k) and k not in default.to_dict())
    if unknown:
        raise SystemExit(f"--set: {cfg_cls} has no field(s) {unknown}")
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(0)
    with torch.device(dev):
        model = getattr(transformers, model_cls)(cfg)
    return model.to(dtype)


def host_probe_us() -> float:
    """The host's speed now: us per 1000 iterations of a plain Python loop (median of 5)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        s = 0
        for i in range(100_000):
            s += i
        times.append((time.perf_counter() - t0) * 1e4)
    return statistics.median(times)


def profiled(step, model: torch.nn.Module, trace: str = "") -> dict:
    """One more step under the profiler (CUDA): its wall time, the GPU's busy time (union of
    kernel intervals), the copies' time, the kernel count, the idle time between kernels, and
    the cudaMalloc calls the allocator made (its cache misses)."""
    from torch.profiler import ProfilerActivity, profile

    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    mallocs = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    mallocs = torch.cuda.memory_stats().get("segment.all.allocated", 0) - mallocs
    if trace:
        prof.export_chrome_trace(trace)
    kern, copies, by_name = [], 0.0, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        if "memcpy" in e.name.lower() or "memset" in e.name.lower():
            copies += (end - start) / 1e3
        else:
            kern.append((start, end))
            by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + (end - start) / 1e3
    kern.sort()
    busy = sum(t - s_ for s_, t in union(kern))
    span = (kern[-1][1] - kern[0][0]) if kern else 0.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {"wall_ms": wall, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "copy_ms": copies, "kernels": len(kern), "mallocs": mallocs,
            "top_kernels_ms": [[n, round(ms, 2)] for n, ms in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_moe", choices=sorted(CONFIGS))
    ap.add_argument("--seq", type=int, default=8192, help="tokens per step (one sequence)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per arm (after 2 warm-up steps)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--experts", default="", help="transformers' experts_implementation ('' = its default: grouped_mm where torch has it)")
    ap.add_argument("--set", type=overrides, default={}, help="config fields over the model's defaults, e.g."
                    " hidden_size=2048,num_attention_heads=32,moe_intermediate_size=1024 (a larger, GPU-bound config)")
    ap.add_argument("--paging", default="", help="extra paging options as JSON, merged into the paging arm's (default: none)")
    ap.add_argument("--paging-b", default="", help="the paging_b arm's options as JSON, over the paging arm's")
    ap.add_argument("--determinism", default="strict", choices=("strict", "warn", "off"),
                    help="torch.use_deterministic_algorithms: strict (True; an op with no deterministic kernel raises), warn (True,"
                         " warn_only: such an op warns and runs its fast kernel, e.g. cuDNN attention's backward on an H200), off")
    ap.add_argument("--profile", action="store_true", help="CUDA: one more step per arm under the profiler: GPU busy time (union of kernels) and copies")
    ap.add_argument("--trace", default="", help="with --profile: write each arm's profiled step as a Chrome trace in this folder"
                    " (benches/trace_stalls.py reads it)")
    ap.add_argument("--pyprofile", action="store_true", help="one more step per arm under cProfile: the Python functions with the most"
                    " time of their own (where the host time goes on a host-bound step)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config on CPU in fp32 (seq 32): checks the script, measures nothing")
    ap.add_argument("--gc", default="auto", choices=("auto", "manual"), help="Python's garbage collector during the timed steps: auto"
                    " (Python's default), manual (off during each step, a young-generation collection between steps, as torchtitan's"
                    " gc_freq does); the collections' count and time per step are printed either way")
    ap.add_argument("--rounds", type=int, default=1, help="run the arms' sequence this many times (each arm compiled again: dynamo reset),"
                    " so that arms compared alternate in time; medians over every round's timed steps, per-round ratios printed")
    ap.add_argument("--dma-mib", type=int, default=2048, help="compiled_dma: MiB copied per step (in 256 MiB copies)")
    ap.add_argument("--dma-dir", default="d2h", choices=("d2h", "h2d", "both"), help="compiled_dma: the copies' direction")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    seq = 32 if a.tiny else a.seq
    # Parity is bit-exact only where the model itself is run-to-run deterministic: on an H200
    # torch's attention (cuDNN) has a non-deterministic backward unless determinism is strict
    # (warn_only keeps the fast kernel: eager vs eager_again then differ; H200, 2026-12-02).
    if a.determinism != "off":
        torch.use_deterministic_algorithms(True, warn_only=a.determinism == "warn")
    base = build(a, dev, dtype)
    params = sum(p.numel() for p in base.parameters())
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    if a.trace and not a.profile:
        raise SystemExit("--trace writes the profiled step's trace: add --profile")
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    if "cudagraphs" in arms and dev.type != "cuda":
        raise SystemExit("the cudagraphs arm needs CUDA")
    paging_opts = {"paging": True, **({"paging_min_bytes": 0} if a.tiny else {}), **json.loads(a.paging or "{}")}
    # One arm after another, torch._dynamo reset before each: arms compiled side by side share
    # dynamo's per-frame caches (and their recompile limits), and on these graph-broken models
    # that let one arm run frames another compiled (measured on CPU: parity lost). The reference
    # arms run first; their losses and gradients of every step are kept on the host.
    order = [x for x in ("eager", "aot_eager") if x in arms] + [x for x in arms if x not in ("eager", "aot_eager")]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {a.rounds}")
    rows = {arm: {"ms": [], "peak": [], "parity": True, "vs_eager": None, "round_ms": [], "host_probe_us": [], "gc_ms": [], "gc_runs": [], "gc_full": [],
                 "fwd_host_ms": [], "bwd_host_ms": []} for arm in arms}
    host_clock = {"fwd": 0.0, "bwd": 0.0}  # the last step's host time in the forward call and in backward() (no sync inside)
    gc_clock = {"t": 0.0, "ms": 0.0, "runs": 0, "full": 0}

    def on_gc(phase: str, info: dict) -> None:  # the collections' time, counted per step
        if phase == "start":
            gc_clock["t"] = time.perf_counter()
        else:
            gc_clock["ms"] += (time.perf_counter() - gc_clock["t"]) * 1e3
            gc_clock["runs"] += 1
            gc_clock["full"] += info.get("generation") == 2

    gc.callbacks.append(on_gc)
    # Paging arms (timed plan): the host time inside the Pager's save hook (`Pager._pack`, in the
    # forward: the page-outs and every candidate kept) and use hook (`Pager._unpack`, in the
    # backward: the page-ins), per step: how much of a paged step's extra host time is the
    # paging calls' own (two perf_counter reads per call, under 1 us).
    hook_clock = {"save": 0.0, "use": 0.0, "saves": 0, "uses": 0}

    def clocked(fn, name: str):
        def timed(self, *args):
            t = time.perf_counter()
            try:
                return fn(self, *args)
            finally:
                hook_clock[name] += (time.perf_counter() - t) * 1e3
                hook_clock[name + "s"] += 1
        return timed

    from sched_lifetime.paging.pager import Pager

    Pager._pack, Pager._unpack = clocked(Pager._pack, "save"), clocked(Pager._unpack, "use")
    kept: dict = {}  # reference arm -> per step, its loss and gradients (host)
    history: dict = {}
    batches = [torch.randint(0, base.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(step)) for step in range(a.steps + 2)]

    dma: dict = {}
    if "compiled_dma" in arms:
        if dev.type != "cuda":
            raise SystemExit("the compiled_dma arm needs CUDA")
        chunk = 256 << 20
        dma.update(n=max(1, a.dma_mib // 256), dev=torch.empty(chunk, dtype=torch.uint8, device=dev),
                   host=torch.empty(chunk, dtype=torch.uint8, pin_memory=True), stream=torch.cuda.Stream(dev))

    def background_copies() -> None:  # compiled_dma: the link busy as paging keeps it, with no paging at all
        with torch.cuda.stream(dma["stream"]):
            for k in range(dma["n"]):
                if a.dma_dir == "d2h" or (a.dma_dir == "both" and k % 2 == 0):
                    dma["host"].copy_(dma["dev"], non_blocking=True)
                else:
                    dma["dev"].copy_(dma["host"], non_blocking=True)

    def one_step(arm: str, run: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if arm == "compiled_dma":
            background_copies()
        if arm == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        with (torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda") if arm == "save_on_cpu" else contextlib.nullcontext()):
            t0 = time.perf_counter()
            loss = run(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            loss.backward()
            host_clock.update(fwd=(t1 - t0) * 1e3, bwd=(time.perf_counter() - t1) * 1e3)
        return loss

    for rnd, arm in ((r, x) for r in range(a.rounds) for x in order):
        last = rnd == a.rounds - 1
        torch._dynamo.reset()
        rows[arm]["host_probe_us"].append(host_probe_us())
        model = copy.deepcopy(base)
        if arm in ("eager", "eager_again", "save_on_cpu"):
            run = model
        elif arm == "aot_eager":
            run = torch.compile(model, backend="aot_eager")
        else:
            opts = paging_opts if arm in ("paging", "paging_pycopy", "paging_gather") else {**paging_opts, **json.loads(a.paging_b or "{}")} if arm == "paging_b" else {} if arm == "compiled_dma" else {"cudagraphs": True} if arm == "cudagraphs" else {}
            run = torch.compile(model, backend="sched_lifetime", options=opts)
        PageStreams.native_copy = arm != "paging_pycopy"
        PageStreams.pitched_copy = arm != "paging_gather"
        for step, ids in enumerate(batches):
            ids = ids.to(dev)
            for p in model.parameters():
                p.grad = None
            before = len(slc.history)
            sync()
            start = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            if a.gc == "manual":
                gc.collect(1)
                gc.disable()
            gc_clock.update(ms=0.0, runs=0, full=0)
            hook_clock.update(save=0.0, use=0.0, saves=0, uses=0)
            t0 = time.perf_counter()
            loss = one_step(arm, run, ids)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            gc_step = dict(gc_clock)
            if a.gc == "manual":
                gc.enable()
            peak = (torch.cuda.max_memory_allocated(dev) - start) if dev.type == "cuda" else 0
            if rnd == 0 and arm not in ("eager", "eager_again", "save_on_cpu", "aot_eager") and len(slc.history) > before:
                history.setdefault(arm, []).extend(slc.history[before:])
            got = [loss.detach()] + [p.grad for p in model.parameters()]
            if rnd == 0 and arm in ("eager", "aot_eager"):
                kept.setdefault(arm, []).append([None if t is None else t.detach().cpu() for t in got])
            ref = kept.get(REFERENCE[arm])
            if ref is not None and arm != REFERENCE[arm]:
                if not all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y.cpu())) for x, y in zip(ref[step], got)):
                    rows[arm]["parity"] = False
            if arm == "aot_eager" and "eager" in kept:
                same = all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(kept["eager"][step], kept["aot_eager"][step]))
                rows[arm]["vs_eager"] = same and rows[arm]["vs_eager"] in (None, True)
            del got, loss
            if step > 1:
                rows[arm]["ms"].append(ms)
                rows[arm]["peak"].append(peak)
                rows[arm]["gc_ms"].append(gc_step["ms"])
                rows[arm]["gc_runs"].append(gc_step["runs"])
                rows[arm]["gc_full"].append(gc_step["full"])
                rows[arm]["fwd_host_ms"].append(host_clock["fwd"])
                rows[arm]["bwd_host_ms"].append(host_clock["bwd"])
                rows[arm].setdefault("hooks", []).append(dict(hook_clock))
        timed = a.steps  # after 2 warm-up steps
        rows[arm]["round_ms"].append(statistics.median(rows[arm]["ms"][-timed:]))
        # One line per arm and round as it ends: a run cut short still says what it measured.
        print(f"round {rnd} {arm}: {rows[arm]['round_ms'][-1]:.1f} ms, peak {max(rows[arm]['peak'][-timed:]) / 2**20:.0f} MiB", flush=True)
        if a.profile and dev.type == "cuda" and last:
            trace = os.path.join(a.trace, f"{a.model}_{arm}.json") if a.trace else ""
            rows[arm]["profile"] = profiled(lambda: one_step(arm, run, batches[-1].to(dev)), model, trace)
        if a.pyprofile and last:
            import cProfile
            import io
            import pstats

            for p in model.parameters():
                p.grad = None
            sync()
            cp = cProfile.Profile()
            cp.enable()
            one_step(arm, run, batches[-1].to(dev))
            sync()
            cp.disable()
            text = io.StringIO()
            pstats.Stats(cp, stream=text).sort_stats("tottime").print_stats(25)
            pstats.Stats(cp, stream=text).sort_stats("cumulative").print_stats("sched_lifetime", 30)
            print(f"== cProfile, arm {arm}, one step (sorted by own time)\n" + text.getvalue())
        del run, model
    out = {"model": a.model, "params": params, "set": a.set, "seq": seq, "dtype": str(dtype), "device": str(dev), "tiny": a.tiny,
           "experts_implementation": base.config._experts_implementation, "paging_options": paging_opts, "paging_b_options": json.loads(a.paging_b or "{}"), "arms": {}}
    print(f"HF A/B: {a.model} ({params / 1e6:.0f}M parameters, experts {base.config._experts_implementation}), seq {seq}, {dtype}, {dev};"
          f" medians of {a.steps} steps per arm (one fwd+bwd each) after 2 warm-up steps, arms one after another"
          + (f", {a.rounds} rounds of the arms (medians over all rounds' steps)" if a.rounds > 1 else ""))
    print(f"{'arm':<14}{'step ms':>9}{'vs ref':>9}{'peak MiB':>10}{'saved':>8}  {'against':<10}{'parity':>7}")
    measured_against = {"eager": "eager", "eager_again": "eager", "save_on_cpu": "eager", "aot_eager": "aot_eager", "compiled": "aot_eager",
                        "cudagraphs": "compiled", "paging": "compiled", "paging_pycopy": "compiled", "paging_gather": "compiled", "paging_b": "compiled", "compiled_dma": "compiled"}
    for arm in arms:
        r = rows[arm]
        # A captured arm's memory is its graph pool, allocated at capture and held: the peak
        # above a replay's start says nothing about it (not measured here).
        ms, peak = statistics.median(r["ms"]), (None if arm == "cudagraphs" else max(r["peak"]))
        ref = measured_against[arm] if measured_against[arm] in rows else arm
        ref_ms, ref_peak = statistics.median(rows[ref]["ms"]), max(rows[ref]["peak"])
        saved = None if peak is None else (1 - peak / ref_peak) if ref_peak else 0.0
        prof = r.get("profile", {})
        out["arms"][arm] = {**({"profile": prof} if prof else {}), "ms": ms, "all_ms": r["ms"], "peak_bytes": peak, "against": ref, "ms_ratio": ms / ref_ms, "peak_saved": saved,
                            "parity": r["parity"], "parity_against": REFERENCE[arm]}
        mib, pct = ("-", "-") if peak is None else (f"{peak / 2**20:.0f}", f"{saved:.1%}")
        checked = REFERENCE[arm] != arm and REFERENCE[arm] in rows  # parity against another arm that ran
        out["arms"][arm]["parity"] = r["parity"] if checked else None
        shown = str(r["parity"]) if checked else "ref" if REFERENCE[arm] == arm else "-"
        print(f"{arm:<14}{ms:>9.1f}{ms / ref_ms:>8.3f}x{mib:>10}{pct:>8}  {ref:<10}{shown:>7}"
              + (f"  profiled step {prof['wall_ms']:.1f} ms: GPU busy {prof['busy_ms']:.1f}, kernels {prof['kernels']}, copies {prof['copy_ms']:.1f} ms,"
                 f" idle between kernels {prof['idle_ms']:.1f} ms, cudaMalloc {prof['mallocs']}" if prof else ""))
    # The host's own speed before each arm's run (a Python loop: this machine's host moved up
    # to 1.8x between seconds with nothing else running, benches/host_under_dma.py), and with
    # rounds, each round's ratio to the arm measured against (the runs next to each other).
    for arm in arms:
        r = rows[arm]
        ref = measured_against[arm] if measured_against[arm] in rows else arm
        out["arms"][arm].update(round_ms=r["round_ms"], host_probe_us=r["host_probe_us"], fwd_host_ms=r["fwd_host_ms"], bwd_host_ms=r["bwd_host_ms"])
        n = len(r["gc_ms"])
        out["arms"][arm].update(gc_ms_per_step=sum(r["gc_ms"]) / n, gc_runs_per_step=sum(r["gc_runs"]) / n, gc_full_per_step=sum(r["gc_full"]) / n)
        line = (f"{arm}: garbage collector ({a.gc}) {sum(r['gc_ms']) / n:.2f} ms in {sum(r['gc_runs']) / n:.1f} collections per timed step"
                f" ({sum(r['gc_full']) / n:.2f} full); host time in the forward call {statistics.median(r['fwd_host_ms']):.1f} ms, in backward()"
                f" {statistics.median(r['bwd_host_ms']):.1f} ms (medians; no sync inside); host probe {', '.join(f'{x:.1f}' for x in r['host_probe_us'])} us per 1000 Python loop iterations")
        hooks = r.get("hooks", [])
        if any(h["saves"] for h in hooks):
            med = {k: statistics.median(h[k] for h in hooks) for k in ("save", "use", "saves", "uses")}
            out["arms"][arm]["pager_hooks"] = med
            line += (f"; of it in the Pager's save hook {med['save']:.1f} ms ({med['saves']:.0f} calls),"
                     f" its use hook {med['use']:.1f} ms ({med['uses']:.0f} calls)")
        if a.rounds > 1:
            ratios = [x / y for x, y in zip(r["round_ms"], rows[ref]["round_ms"])]
            out["arms"][arm]["round_ratios"] = ratios
            line += f"; round medians {', '.join(f'{x:.1f}' for x in r['round_ms'])} ms" + (f", vs {ref} {', '.join(f'{x:.3f}x' for x in ratios)}" if ref != arm else "")
        print(line)
    for arm in arms:
        top = rows[arm].get("profile", {}).get("top_kernels_ms")
        if top:
            print(f"{arm}: top kernels of the profiled step: " + "; ".join(f"{n} {ms:.1f} ms" for n, ms in top))
    if rows.get("aot_eager", {}).get("vs_eager") is not None:
        out["aot_eager_bit_exact_with_eager"] = rows["aot_eager"]["vs_eager"]
        print(f"aot_eager bit-exact with eager: {rows['aot_eager']['vs_eager']}")
    for arm, hs in history.items():
        fwd = [h for h in hs if h["phase"] == "fwd"]
        mem = [h["schedule"]["memory"] for h in hs if h.get("schedule") and h["schedule"].get("memory")]
        info = {"fwd_graphs": len(fwd), "bwd_graphs": len(hs) - len(fwd),
                "kept_aot_order": sum(m["kept_table_order"] for m in mem),
                "est_peak_vs_aot_order": max((m["scheduled_peak_bytes"] / m["baseline_peak_bytes"] for m in mem if m["baseline_peak_bytes"]), default=None)}
        pagers = {id(p): p for h in hs if (p := h["module"].sched_lifetime.get("paging")) is not None}.values()
        if pagers:
            info["paging"] = {"bytes_out": sum(p.stats["bytes_out"] for p in pagers), "run_slots": sum(len(p.runs) for p in pagers),
                              "explain": [p.explain() for p in pagers]}
            plans = [p.plan for p in pagers if p.plan is not None]
            if plans:  # per step: how many values paged, how many kept for host time, the host time measured
                text = [line for pl in plans for line in pl["explain"]]
                info["paging"]["paged_values"] = sum(len(pl["page"]) for pl in plans)
                info["paging"]["kept_for_host_time"] = sum("us of host time" in line for line in text)
                info["paging"]["page_host_us"] = [(pl.get("timing") or {}).get("page_host_us") for pl in plans]
                # Page-ins are queued in batches, one per backward point the plan launches some at
                # (`Pager._unpack`): how many such points (each one wait for the compute stream).
                info["paging"]["page_in_points"] = sum(len(set(pl["launch_at"])) for pl in plans if pl.get("launch_at") is not None)
        out["arms"][arm]["graphs"] = info
        print(f"{arm}: {info['fwd_graphs']} fwd / {info['bwd_graphs']} bwd graphs, AOT order kept in {info['kept_aot_order']},"
              f" scheduled/AOT estimated peak at most {info['est_peak_vs_aot_order']}" + (f", paged {info['paging']['bytes_out'] / 2**20:.0f} MiB in all, {info['paging']['run_slots']} run slots" if pagers else "")
              + (f", {info['paging']['paged_values']} values paged per step, {info['paging']['kept_for_host_time']} kept for host time"
                 f" (a page-out and its page-in: {info['paging']['page_host_us']} us of host), their page-ins queued at"
                 f" {info['paging']['page_in_points']} points" if "paged_values" in info.get("paging", {}) else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
