"""Time fast_causal_attn forward and forward+backward beside plain PyTorch and the peers present.

    python benchmarks/benchmark.py                 # on CUDA when present, else on the CPU
    python benchmarks/benchmark.py --device cpu --dtypes float32,bfloat16

Prints a table, writes benchmarks/out/<device>.json and, with matplotlib, <device>.png. Every
time is a median after warm-up (triton.testing.do_bench on CUDA); each is printed beside the
memory floor: the fewest bytes the pass must move (read q, k, v and write o; the backward also
reads dO and writes dq, dk, dv) over the copy bandwidth measured in the same run.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402

import fast_causal_attn  # noqa: E402

SHAPES = {  # (B, H, L, E, M)
    "cpu": [(4, 8, 2048, 64, 64), (1, 2, 8192, 64, 64), (8, 8, 1024, 32, 32)],
    "cuda": [
        (8, 16, 2048, 64, 64),
        (4, 16, 8192, 64, 64),
        (8, 16, 2048, 128, 128),
        (2, 4, 8192, 64, 64),
        (1, 16, 32768, 128, 128),
        (4, 16, 2048, 256, 256),
        (8, 16, 2048, 64, 128),
    ],
}
DTYPES = {"cpu": "float32", "cuda": "float32,bfloat16"}


def median_ms(fn, device, reps):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=100, rep=max(200, reps * 20), return_mode="median")
    fn()  # warm-up: thread pool, allocator, first-touch
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device):
    """Bytes read plus bytes written per second by a large device copy."""
    n = (1 << 28) if device == "cuda" else (1 << 25)  # floats: 1 GiB on the GPU, 128 MiB on the CPU
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def floor_ms(B, H, L, E, M, item, bandwidth):
    """The memory floor in ms (forward, forward+backward) at `bandwidth` bytes a second: the forward
    reads q, k, v and writes o; the backward reads q, k, v, dO and writes dq, dk, dv."""
    fwd_bytes, bwd_bytes = B * H * L * (2 * E + 2 * M) * item, B * H * L * (4 * E + 4 * M - E) * item
    return fwd_bytes / bandwidth * 1e3, (fwd_bytes + bwd_bytes) / bandwidth * 1e3


def make_case(B, H, L, E, M, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g) / E**0.5
    k = torch.randn(B, H, L, E, generator=g) / E**0.5
    v = torch.randn(B, H, L, M, generator=g)
    dout = torch.randn(B, H, L, M, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


def calls(fn, q, k, v, dout):
    """The forward (no autograd) and forward+backward calls of fn(q, k, v) that are timed."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            return fn(q, k, v)

    def forward_backward():
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, dout)

    return forward, forward_backward


def timings(fn, q, k, v, dout, device, reps):
    """(forward ms, forward+backward ms) of fn(q, k, v)."""
    forward, forward_backward = calls(fn, q, k, v, dout)
    return median_ms(forward, device, reps), median_ms(forward_backward, device, reps)


_zero_states = {}  # (B, H, E, M, dtype, device) -> a zero State, made once a case (not in the timed calls)


def with_zero_state(q, k, v, normalize=False):
    """The default path with a state in and out: a zero initial state (float32, or float64 for
    float64 inputs) and the final state returned beside the output, which is returned alone (the
    plain output, or with normalize the normalized one; the state's gradient is None in the timed
    backward)."""
    B, H, _, E = q.shape
    key = (B, H, E, v.shape[-1], q.dtype, q.device)
    if key not in _zero_states:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        _zero_states[key] = fast_causal_attn.State(q.new_zeros(B, H, E, v.shape[-1], dtype=acc),
                                                   q.new_zeros(B, H, E, dtype=acc))
    out, _ = fast_causal_attn.causal_linear_attention(q, k, v, normalize=normalize, initial_state=_zero_states[key],
                                                      return_final_state=True)
    return out


def float64_results(q, k, v, dout, normalize=False):
    """The output and the gradients of q, k and v in float64 for these (rounded) inputs: plain
    PyTorch's chunked form, an independent implementation, on the inputs' device (`normalize`:
    normalized, eps 1e-6, as causal_linear_attention's default)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = (baselines.torch_chunked_normalized if normalize else baselines.torch_chunked)(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.double())]


def relative_errors(fn, q, k, v, dout, exact, blhd=False):
    """Norm-wise relative errors ||x - exact|| / ||exact|| (the tests' measure) of fn's output and
    of its gradients of q, k and v; `blhd`: fn takes and returns [B, L, H, D]."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    results = [out, *torch.autograd.grad(out, leaves, dout)]
    if blhd:
        results = [x.transpose(1, 2) for x in results]
    return [((x.double() - r).norm() / r.norm()).item() for x, r in zip(results, exact)]


def kernel_breakdown(fn, iters=20):
    """The device time of one fn() call (ms, every kernel, copy and fill summed, from torch's
    profiler) and its parts [(ms, launches, name)], largest first. Beside a do_bench median, it
    tells how much of a call's time the GPU was busy: the rest is host work and launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    parts = [(e.self_device_time_total / iters / 1e3, e.count / iters, e.key) for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    parts.sort(reverse=True)
    return sum(ms for ms, _, _ in parts), parts


def graph_ms(fn):
    """The GPU's wall time of one fn() call (ms) with no host work in it: fn captured once in a
    CUDA graph, the replays' do_bench median. Where kernels overlap (a pass launched as the
    programmatic dependent of the one before), the sum of their durations (kernel_breakdown)
    counts the overlap twice; this does not."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=100, rep=200, return_mode="median")


def host_ms(fn, iters=20, batches=7):
    """The host's time to issue one fn() call (ms): batches of iters calls back to back, the GPU
    not waited for within a batch (few enough launches not to fill its queue) and waited for
    between batches; the median of the batches' means. Beside the GPU's busy time it tells a call
    bound by its host work (host >= busy) from one whose kernels leave the GPU idle between them.
    (One batch alone moved up to 2x between runs on the H200's host: RESULTS.md, twenty-seventh
    session.)"""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append((time.perf_counter() - start) / iters)
        torch.cuda.synchronize()
    return statistics.median(per_call) * 1e3


@contextlib.contextmanager
def method_settings(environment, *, tf32):
    """A method's switches while it is timed, profiled or checked: its environment variables
    (FAST_CAUSAL_ATTN_KERNEL, a sweep's value, ...) and torch's TF32 switch for float32 matmuls."""
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    previous = {variable: os.environ.get(variable) for variable in environment}
    os.environ.update(environment)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        for variable, value in previous.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtypes", default=None, help="comma-separated, e.g. float32,bfloat16")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions on the CPU")
    parser.add_argument("--shapes", default=None,
                        help="semicolon-separated B,H,L,E,M shapes instead of the device's list, e.g. '2,4,8192,64,64'")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    parser.add_argument("--no-peers", action="store_true", help="skip fast-transformers and fla even when present")
    parser.add_argument("--families", action="store_true",
                        help="on CUDA, also time each kernel family forced (FAST_CAUSAL_ATTN_KERNEL)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated substrings: time only the methods whose name holds one, e.g. 'tensorcore,fla'")
    parser.add_argument("--sweep", action="append", default=[], metavar="VARIABLE=V1,V2,...[;OTHER=VALUE...]",
                        help="also time the default path with an environment variable at each value, e.g. "
                             "'FAST_CAUSAL_ATTN_SEGMENTS=1,2,4', optionally with others set throughout, e.g. "
                             "'FAST_CAUSAL_ATTN_TC_BUFFERS=1,2;FAST_CAUSAL_ATTN_KERNEL=tensorcore' (repeatable)")
    parser.add_argument("--kernel-time", action="store_true",
                        help="on CUDA, also profile each of this library's methods and fla's: the GPU's busy time per call, "
                             "its kernels, the host's time to issue the call (host work and launch gaps are "
                             "the rest of the median) and the call's time replayed from a CUDA graph (no host "
                             "work; overlapping kernels counted once)")
    parser.add_argument("--accuracy", action="store_true",
                        help="also each method's relative error (output, dq, dk, dv) against float64 on the same "
                             "rounded inputs (issue 5: bf16 <= 2.3e-3, fp32 <= 1e-5)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the default path under torch.compile (static shapes, fullgraph), as a "
                             "compiled training step calls it")
    parser.add_argument("--features", default="", metavar="normalize,state",
                        help="also time the default path with these features on, each a method of its own: "
                             "'fca normalize' (normalize=True; fla normalized beside it) and 'fca state' (a "
                             "zero initial state in, the final state returned: the plain output, so --accuracy "
                             "applies); --accuracy measures the normalized methods on |q| and |k| against a "
                             "normalized float64 reference (their timings use the signed inputs)")
    parser.add_argument("--warm-peers", action="store_true",
                        help="run each peer once per case (compiling fla's Triton kernels into the cache), time nothing")
    args = parser.parse_args()

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [getattr(torch, d) for d in (args.dtypes or DTYPES[device]).split(",")]
    reps = args.reps or (10 if device == "cpu" else 50)
    shapes = SHAPES[device]
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";")]
        if any(len(shape) != 5 for shape in shapes):
            parser.error(f"--shapes wants B,H,L,E,M groups, got {args.shapes!r}")
    bandwidth = copy_bandwidth(device)
    where = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"fast_causal_attn benchmark on {device} ({where}), torch {torch.__version__}")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)\n")

    methods = {
        "fast_causal_attn": fast_causal_attn.causal_dot_product,
        "torch chunked (C=64)": baselines.torch_chunked,
    }
    families = {}  # method name -> the environment while it is timed (FAST_CAUSAL_ATTN_KERNEL, ...)
    if args.families and device == "cuda":
        for family in ("recurrent", "chunked", "tensorcore"):
            methods[f"fca {family}"] = fast_causal_attn.causal_dot_product
            families[f"fca {family}"] = {"FAST_CAUSAL_ATTN_KERNEL": family}
        # the gradients of k and v in two passes instead of one (the default where E, M <= 64)
        methods["fca tensorcore two-pass-kv"] = fast_causal_attn.causal_dot_product
        families["fca tensorcore two-pass-kv"] = {"FAST_CAUSAL_ATTN_KERNEL": "tensorcore", "FAST_CAUSAL_ATTN_FUSED_GRAD_KV": "0"}
        # float32 with torch's TF32 switch on (one TF32 product a step), as fla's float32 runs
        methods["fca tensorcore tf32"] = fast_causal_attn.causal_dot_product
        families["fca tensorcore tf32"] = {"FAST_CAUSAL_ATTN_KERNEL": "tensorcore"}
    if args.compiled:
        # one graph per shape, dtype and grad mode: more than dynamo's default limit of 8
        torch._dynamo.config.recompile_limit = 256
        methods["fca compiled"] = torch.compile(fast_causal_attn.causal_dot_product, dynamic=False, fullgraph=True)
    def short(variable):
        return variable.removeprefix("FAST_CAUSAL_ATTN_").lower()

    for sweep in args.sweep:
        swept, *fixed = sweep.split(";")  # VARIABLE=V1,V2[;OTHER=VALUE...]: each value with the others set
        variable, _, values = swept.partition("=")
        fixed = dict(item.partition("=")[::2] for item in fixed)
        if not variable or not values or not all(fixed) or not all(fixed.values()):
            parser.error(f"--sweep wants VARIABLE=V1,V2,...[;OTHER=VALUE...], got {sweep!r}")
        suffix = "".join(f" {short(k)}={v}" for k, v in fixed.items())
        for value in values.split(","):
            name = f"fca {short(variable)}={value}{suffix}"
            methods[name] = fast_causal_attn.causal_dot_product
            families[name] = {variable: value, **fixed}
    features = [f for f in args.features.split(",") if f]
    if any(f not in ("normalize", "state") for f in features):
        parser.error(f"--features takes normalize and state, got {args.features!r}")
    if "normalize" in features:
        methods["fca normalize"] = lambda q, k, v: fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
    if "state" in features:
        methods["fca state"] = with_zero_state
    if not args.no_peers and device == "cuda":
        # float32 with torch's TF32 switch on (the default path; TF32 products where the user allows
        # them), beside fla's float32, which runs in TF32
        methods["fast_causal_attn tf32"] = fast_causal_attn.causal_dot_product
    ft = None if args.no_peers else baselines.fast_transformers_causal_dot_product(device)
    fla = {} if args.no_peers else baselines.fla_linear_attention(device)  # [B, L, H, D] inputs
    if fla and "normalize" in features:
        fla.update(baselines.fla_linear_attention(device, normalize=True))

    rows = []
    header = (f"{'dtype':9} {'B, H, L, E, M':>22} {'method':>22} {'fwd ms':>9} {'fwd+bwd ms':>11} "
              f"{'floor fwd / fwd+bwd':>20} {'x floor':>12}")
    print(header)
    print("-" * len(header))
    for dtype in dtypes:
        for shape in shapes:
            B, H, L, E, M = shape
            q, k, v, dout = make_case(*shape, dtype, device)
            floor = floor_ms(*shape, q.element_size(), bandwidth)
            cases = dict(methods)
            if dtype == torch.float64:
                cases.pop("fca tensorcore", None)  # float16, bfloat16 and float32 only
                cases.pop("fca tensorcore two-pass-kv", None)
            if dtype != torch.float32:
                cases = {name: fn for name, fn in cases.items() if not name.endswith("tf32")}
            if ft is not None and dtype == torch.float32:
                cases["fast-transformers"] = ft
            cases.update(fla)
            if args.methods:
                cases = {name: fn for name, fn in cases.items() if any(m in name for m in args.methods.split(","))}
            blhd = [x.transpose(1, 2).contiguous() for x in (q, k, v, dout)] if fla else None
            exact = float64_results(q, k, v, dout) if args.accuracy and not args.warm_peers else None
            # the normalized methods' accuracy on |q| and |k| (a positive feature map's: with signed
            # q and k the normalizer can pass near 0), against the normalized float64 reference
            positive = lambda xs: (xs[0].abs(), xs[1].abs(), *xs[2:])  # noqa: E731
            exact_normalized = (float64_results(*positive((q, k, v, dout)), normalize=True)
                                if exact and "normalize" in features else None)
            if args.warm_peers:  # gpu_check.sh runs this beside the build and tests, so that timing finds them compiled
                for name, fn in cases.items():
                    if name in fla or name == "fast-transformers":
                        inputs = blhd if name in fla else (q, k, v, dout)
                        with torch.no_grad():
                            fn(*inputs[:3])
                        leaves = [x.detach().requires_grad_() for x in inputs[:3]]
                        torch.autograd.grad(fn(*leaves), leaves, inputs[3])
                        print(f"warmed {name} {dtype} {shape}", flush=True)
                continue
            for name, fn in cases.items():
                with method_settings(families.get(name, {}), tf32=name.endswith("tf32")):
                    inputs = blhd if name in fla else (q, k, v, dout)
                    fwd, fwd_bwd = timings(fn, *inputs, device, reps)
                    normalized = name.endswith(" normalize")
                    reference = exact_normalized if normalized else exact
                    errors = (relative_errors(fn, *(positive(inputs) if normalized else inputs), reference, blhd=name in fla)
                              if reference else None)
                rows.append(dict(dtype=str(dtype).replace("torch.", ""), shape=shape, method=name,
                                 fwd_ms=fwd, fwd_bwd_ms=fwd_bwd, floor_fwd_ms=floor[0], floor_fwd_bwd_ms=floor[1]))
                print(f"{rows[-1]['dtype']:9} {str(shape):>22} {name:>22} {fwd:9.3f} {fwd_bwd:11.3f} "
                      f"{floor[0]:9.3f} / {floor[1]:.3f} {fwd / floor[0]:5.1f} / {fwd_bwd / floor[1]:4.1f}", flush=True)
                if errors:
                    rows[-1].update(zip(("error_out", "error_dq", "error_dk", "error_dv"), errors))
                    print(f"{'':34} relative error vs float64: out {errors[0]:.2e}, dq {errors[1]:.2e}, "
                          f"dk {errors[2]:.2e}, dv {errors[3]:.2e}", flush=True)
                if args.kernel_time and device == "cuda" and (name == "fast_causal_attn" or name.startswith("fca ") or name in fla):
                    with method_settings(families.get(name, {}), tf32=name.endswith("tf32")):
                        busy, host, graph = {}, {}, {}
                        for what, call in zip(("fwd", "fwd+bwd"), calls(fn, *inputs)):
                            busy[what], parts = kernel_breakdown(call)
                            host[what] = host_ms(call)
                            try:
                                graph[what] = graph_ms(call)
                            except RuntimeError as error:  # shown, not hidden: the row says why
                                graph[what] = float("nan")
                                print(f"{'':34} {what:>7} CUDA graph capture failed: {str(error)[:120]}")
                            for ms, launches, kernel in parts[:6]:
                                print(f"{'':34} {what:>7} {ms:8.4f} ms {launches:4.1f}x {kernel[:90]}")
                    rows[-1].update(busy_fwd_ms=busy["fwd"], busy_fwd_bwd_ms=busy["fwd+bwd"],
                                    host_fwd_ms=host["fwd"], host_fwd_bwd_ms=host["fwd+bwd"],
                                    graph_fwd_ms=graph["fwd"], graph_fwd_bwd_ms=graph["fwd+bwd"])
                    print(f"{'':34} GPU busy per call: {busy['fwd']:.3f} / {busy['fwd+bwd']:.3f} ms; "
                          f"host per call: {host['fwd']:.3f} / {host['fwd+bwd']:.3f} ms; "
                          f"CUDA graph replay: {graph['fwd']:.3f} / {graph['fwd+bwd']:.3f} ms", flush=True)

    if args.warm_peers:
        return
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=device, device_name=where, torch=torch.__version__, copy_bandwidth=bandwidth,
                date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv))
    path = os.path.join(args.out, f"{device}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\nwrote {path}")
    plot(rows, os.path.join(args.out, f"{device}.png"), meta)


def plot(rows, path, meta):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    groups = sorted({(r["dtype"], tuple(r["shape"])) for r in rows}, key=str)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.6 * len(groups) + 2.5))
    for ax, key, title in zip(axes, ("fwd_ms", "fwd_bwd_ms"), ("forward", "forward + backward")):
        for i, method in enumerate(methods):
            ys, xs = [], []
            for j, g in enumerate(groups):
                for r in rows:
                    if r["method"] == method and (r["dtype"], tuple(r["shape"])) == g:
                        ys.append(j + i * 0.8 / len(methods))
                        xs.append(r[key])
            ax.barh(ys, xs, height=0.8 / len(methods), label=method)
        floors = [next(r for r in rows if (r["dtype"], tuple(r["shape"])) == g)["floor_" + key] for g in groups]
        ax.scatter(floors, [j + 0.4 for j in range(len(groups))], marker="|", s=300, c="k", label="memory floor")
        ax.set_yticks([j + 0.4 for j in range(len(groups))])
        ax.set_yticklabels([f"{d} {s}" for d, s in groups], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("ms (median)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"fast_causal_attn on {meta['device_name']}, torch {meta['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
