"""Checks and times the E = M = 256 forward prototype with the state transposed in registers
(benchmarks/transposed256.cu) beside this library's forward, forward and reversed (out[t] = sum over
s >= t: the backward's dk and dv passes' shape):

    python benchmarks/transposed256.py [--shapes "B,H,L;..."] [--dtype float16] [--check-only] [--no-library]

bfloat16 (or float16: the state's copy in one part, each of its rows scaled), contiguous [B, H, L,
256], L a multiple of 64, scale 1, unnormalized; q and k N(0, 1/E), v N(0, 1) (issue 5's inputs).
Correctness first, against float64 at small shapes (one chunk, two, ten; both column tiles) beside
this library's error (or, --no-library, plain PyTorch's in the dtype); then do_bench medians beside
the HBM floor (read q, k, v, write o at the copy bandwidth measured here), each timed output
against this library's (or the float64 reference's at the check shape).
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
    """The prototype JIT-built for sm_90a (`python -c "import transposed256; transposed256.load()"`
    from benchmarks/ builds it beside the library's build)."""
    return build_beside_library("transposed256", "transposed256.cu")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4,16,2048;2,16,4096;8,16,1024")
    parser.add_argument("--check-only", action="store_true", help="the float64 checks alone (under a sanitizer)")
    parser.add_argument("--no-library", action="store_true", help="without this library's build")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()

    library_forward = None
    if not args.no_library:
        import fast_causal_attn
        library_forward = fast_causal_attn.causal_dot_product

    gen = torch.Generator().manual_seed(0)

    dtype = getattr(torch, args.dtype)

    def inputs(B, H, L):
        return issue_inputs(B, H, L, E, gen, dtype=dtype)

    module = load()
    worst = 0.0
    for B, H, L in ((1, 1, 64), (1, 2, 128), (2, 3, 640)):  # one chunk, two (both slots), ten
        q, k, v = inputs(B, H, L)
        line = []
        for reverse in (False, True):
            exact = reference(q.cpu(), k.cpu(), v.cpu(), reverse=reverse)
            error = relative_error(module.forward(q, k, v, reverse).cpu(), exact)
            if library_forward is None or reverse:  # plain PyTorch in the dtype: the scores rounded, then times v
                scores = q @ k.transpose(-1, -2)
                bound = relative_error((scores.triu() if reverse else scores.tril()) @ v, exact.cuda())
                bound_name = f"plain PyTorch {args.dtype}"
            else:
                bound, bound_name = relative_error(library_forward(q, k, v).cpu(), exact), "this library"
            ok = error <= 1.25 * bound + 1e-4
            worst = max(worst, error / (1.25 * bound + 1e-4))
            line.append(f"{'reversed' if reverse else 'forward'} {error:.2e} ({bound_name} {bound:.2e}: "
                        f"{'match' if ok else 'WRONG'})")
        print(f"float64 check, {B},{H},{L},{E}: " + ", ".join(line), flush=True)
    if worst > 1 or args.check_only:
        return

    for (B, H, L), (q, k, v), floor in prototype_shapes(args.shapes, inputs):
        runs, expected, expected_reverse = [], None, None
        if library_forward is not None:
            # the reverse direction against the library's forward of the time-reversed sequences
            expected, expected_reverse = library_forward(q, k, v).double(), reversed_forward(library_forward, q, k, v)
            runs.append(("fast_causal_attn", lambda: library_forward(q, k, v), None))
        runs += [("transposed", lambda: module.forward(q, k, v, False), expected),
                 ("transposed reversed", lambda: module.forward(q, k, v, True), expected_reverse)]
        if library_forward is not None:
            runs.append(("fast_causal_attn again", lambda: library_forward(q, k, v), None))
        time_runs(f"{B},{H},{L},{E} {args.dtype}", runs, floor, "this library", 22)

if __name__ == "__main__":
    main()
