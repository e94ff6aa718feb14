"""Checks and times the E = M = 256 column-halves forward prototype (benchmarks/columns256.cu) beside
this library's forward (the four-atom row split), and its reverse direction (out[t] = sum over s >=
t: the backward's dk and dv passes' shape) beside itself forward:

    python benchmarks/columns256.py [--shapes "B,H,L;..."]
    python benchmarks/columns256.py --cluster     # the cluster kernel beside the shared schedule
    compute-sanitizer --tool racecheck python benchmarks/columns256.py --check-only

bf16, contiguous [B, H, L, 256], L a multiple of 64, scale 1, unnormalized; q and k N(0, 1/E), v
N(0, 1) (issue 5's inputs). Correctness first: against float64 at a small shape beside this
library's error there, and against this library at each timed shape; then do_bench medians of
both beside the HBM floor (read q, k, v, write o at the copy bandwidth measured here).
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from baselines import issue_inputs, prototype_shapes, reversed_forward, time_runs  # noqa: E402
from baselines import max_relative_error as relative_error  # noqa: E402
from baselines import quadratic_reference as reference  # noqa: E402
from wgmma_probe import build_beside_library  # noqa: E402

E = 256


def load():
    """The prototype JIT-built for sm_90a (no build of the library needed: `python -c "import
    columns256; columns256.load()"` from benchmarks/ builds it beside the library's build)."""
    return build_beside_library("columns256", "columns256.cu")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4,16,2048;2,16,4096;8,16,1024")
    parser.add_argument("--check-only", action="store_true", help="the float64 check alone (under a sanitizer)")
    parser.add_argument("--no-library", action="store_true",
                        help="without this library's build: the schedules checked against float64 beside plain "
                             "PyTorch's bfloat16 error, and against the first schedule's outputs")
    parser.add_argument("--cluster", action="store_true",
                        help="the cluster kernel (q and k multicast to two column tiles) beside the shared schedule "
                             "alone (its own process: a kernel that hangs takes only this run with it)")
    args = parser.parse_args()

    if args.no_library:
        library_forward = None
    else:
        import fast_causal_attn
        library_forward = fast_causal_attn.causal_dot_product

    gen = torch.Generator().manual_seed(0)

    def inputs(B, H, L):
        return issue_inputs(B, H, L, E, gen)

    module = load()
    # the prototype's schedules (columns256.cu's Schedule); reversed, the early stage alone; and the
    # two diagnostics (timed, their outputs wrong by design): the loads alone, the products alone
    schedules = {"shared": 0, "own full": 1, "ping-pong": 2, "early release": 3, "early stage": 4}
    diagnostics = {"loads only": 5, "compute only": 6}
    if args.cluster:
        schedules, diagnostics = {"shared": 0}, {}

    def forward(q, k, v, n):  # schedule n, or the cluster kernel (n = "cluster")
        return module.forward_cluster(q, k, v) if n == "cluster" else module.forward(q, k, v, False, n)

    if args.cluster:
        schedules["cluster"] = "cluster"
    q, k, v = inputs(2, 3, 640)  # ten chunks: the state carried across chunks and both stage slots
    exact = reference(q.cpu(), k.cpu(), v.cpu())
    errors = {name: relative_error(forward(q, k, v, n).cpu(), exact) for name, n in schedules.items()}
    errors["early stage reversed"] = relative_error(module.forward(q, k, v, True, 4).cpu(),
                                                  reference(q.cpu(), k.cpu(), v.cpu(), reverse=True))
    if library_forward is None:  # plain PyTorch in bfloat16: the scores rounded, then times v
        bound_name, bound = "plain PyTorch bf16", relative_error((q @ k.transpose(-1, -2)).tril() @ v, exact.cuda())
    else:
        bound_name, bound = "this library", relative_error(library_forward(q, k, v).cpu(), exact)
    verdict = "match" if max(errors.values()) <= 1.25 * bound + 1e-4 else "WRONG"
    print("float64 check, 2,3,640,256: " + ", ".join(f"{name} {e:.2e}" for name, e in errors.items()) +
          f", {bound_name} {bound:.2e}: {verdict}", flush=True)
    if verdict != "match" or args.check_only:
        return

    for (B, H, L), (q, k, v), floor in prototype_shapes(args.shapes, inputs):
        # against this library's forward (or without it, the first schedule's), and the reverse
        # direction against the same forward on the time-reversed sequences, reversed
        against_name = "the first schedule" if library_forward is None else "this library"
        forward_of = library_forward or (lambda *xs: module.forward(*xs, False, 0))
        expected, expected_reverse = forward_of(q, k, v).double(), reversed_forward(forward_of, q, k, v)
        runs = [(name, lambda n=n: forward(q, k, v, n), expected) for name, n in schedules.items()]
        if library_forward is not None:
            runs.append(("fast_causal_attn", lambda: library_forward(q, k, v), None))
        runs += [("early st. reversed", lambda: module.forward(q, k, v, True, 4), expected_reverse),
                 ("shared again", lambda: module.forward(q, k, v, False, 0), None)]
        runs += [(name, lambda n=n: module.forward(q, k, v, False, n), None) for name, n in diagnostics.items()]
        time_runs(f"{B},{H},{L},{E}", runs, floor, against_name, 18)

if __name__ == "__main__":
    main()
