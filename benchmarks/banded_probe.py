"""Does the forward gain from running a long sequence in time bands whose k and v fit the L2?

At E = M = 128 with few (sequence, head) pairs (1,16,32768,128) the forward runs in three launches:
the state-only blocks read k and v of every segment but the last for its sum, a scan, then the
pass reads q, k and v: 4 + 2 (S - 1) / S tensors, 1.43x the floor's bytes at S = 7. If the pass
found the state-only launch's k and v in the L2 it would read only q from HBM. The sequence cut
into R bands, each run (all three launches) from the band before's final state, keeps one band's
k and v (268 MB / R at 1,16,32768,128 bf16) between its state-only launch and its pass; this
measures that through the public API (initial_state, return_final_state), before any kernel is
written for it. Per R: the GPU's time of the forward and of forward+backward (CUDA graph replay;
autograd runs the bands' backward passes from the last band back, each from the gradient of the
band after it), the kernels' summed durations by name, and the bands' output against the whole
call's. (The bands' outputs stay separate tensors, as one kernel of this design would write one.)

Outcome (H100, bf16, seventy-fourth session; RESULTS.md): every R > 1 slower, the design dropped.
At 1,16,32768,128 the forward 0.291 ms at R = 1, 0.369 at 2, 1.042 at 16: the pass's launches
themselves grew (0.280 -> 0.317 -> 0.814 ms summed), each band's blocks running shorter segments.

    python benchmarks/banded_probe.py [--shapes "1,16,32768,128,128;4,16,8192,128,128"] [--bands 1,2,4,8,16]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import copy_bandwidth, floor_ms, graph_ms, kernel_breakdown, make_case  # noqa: E402

import fast_causal_attn  # noqa: E402


def band_lengths(L, bands):
    """The lengths of `bands` time bands of L steps, as equal as whole steps make them."""
    return [L * (i + 1) // bands - L * i // bands for i in range(bands)]


def banded_forward(q, k, v, bands):
    """The forward of [B, H, L, *] inputs in `bands` time bands (band_lengths), each from the one
    before's final state: the bands' outputs, a list."""
    outs, state = [], None
    for i, (qb, kb, vb) in enumerate(zip(*(x.split(band_lengths(q.shape[2], bands), dim=2) for x in (q, k, v)))):
        if i == bands - 1:  # (no final state: the whole call's own work, its key sum's launch not added)
            outs.append(fast_causal_attn.causal_linear_attention(qb, kb, vb, initial_state=state))
        else:
            out, state = fast_causal_attn.causal_linear_attention(qb, kb, vb, initial_state=state,
                                                                  return_final_state=True)
            outs.append(out)
    return outs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,16,32768,128,128;4,16,8192,128,128;1,16,32768,64,64")
    parser.add_argument("--bands", default="1,2,4,8,16")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth("cuda")  # bytes a second, measured in this run (METHOD.md)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for shape in args.shapes.split(";"):
        shape = tuple(int(x) for x in shape.split(","))
        q, k, v, dout = make_case(*shape, dtype, "cuda")
        floor = dict(zip(("fwd", "fwd+bwd"), floor_ms(*shape, q.element_size(), bandwidth)))
        with torch.no_grad():
            whole = fast_causal_attn.causal_linear_attention(q, k, v).float()
        print(f"\n== {','.join(map(str, shape))} {args.dtype}: floor {floor['fwd']:.4f} / "
              f"{floor['fwd+bwd']:.4f} ms", flush=True)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        for bands in (int(x) for x in args.bands.split(",")):
            with torch.no_grad():
                diff = (torch.cat(banded_forward(q, k, v, bands), dim=2).float() - whole).norm() / whole.norm()
            print(f"bands {bands:2d}: vs the whole call {diff.item():.1e}", flush=True)
            douts = dout.split(band_lengths(shape[2], bands), dim=2)

            def forward():
                with torch.no_grad():
                    return banded_forward(q, k, v, bands)

            def forward_backward():  # (autograd runs the bands' backward from the last band back)
                return torch.autograd.grad(banded_forward(*leaves, bands), leaves, douts)

            for what, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
                gpu = graph_ms(fn)
                busy, parts = kernel_breakdown(fn)
                print(f"  {what:7}: graph {gpu:.4f} ms ({gpu / floor[what]:.2f}x floor), kernels {busy:.4f} ms",
                      flush=True)
                for ms, count, name in parts[:7]:
                    print(f"    {ms:.4f} ms  x{count:g}  {name[:110]}")


if __name__ == "__main__":
    main()
