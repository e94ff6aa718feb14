# Numerics of dq made in the reverse walk of dk and dv (a design: benchmarks/experiments/README.md,
# "dq beside dk and dv in one reverse pass"), on the CPU in seconds, bfloat16-rounded inputs,
# against a float64 reference:
#   1. the float32 master of the state taken down from the segment's end, S(c) = S(c + 1) - v_c^T k_c,
#      beside today's forward walk (S built up);
#   2. the pass as a kernel would run it, T = -S(c + 1) from -S(end) and -dq_c = dO_c T + U(P) k_c
#      (P = dO_c v_c^T, U keeping s > t), with the bfloat16 kernels' roundings (the state's copy in
#      dO T as two bfloat16 parts, the scores rounded to bfloat16), beside today's dq pass rounded
#      the same way.
# python benchmarks/experiments/downdate_dq.py
import torch

torch.manual_seed(0)
C = 64


def bf(x):
    return x.to(torch.bfloat16).to(torch.float32)


def copy(x):  # the bfloat16 kernels' state copy: a head and the remainder's head (StateCopy)
    return bf(x) + bf(x - bf(x))


def inputs(L, E, M, dist):
    k = (torch.randn(L, E) / E**0.5).bfloat16().double()
    v = torch.randn(L, M).bfloat16().double()
    if dist == "positive":  # every term adds with the same sign: the state grows as L, not sqrt(L)
        k, v = k.abs(), v.abs()
    return k, v, torch.randn(L, M).bfloat16().double()


def reference(k, v, do):
    L, E = k.shape
    out, S = torch.empty(L, E, dtype=torch.float64), torch.zeros(v.shape[1], E, dtype=torch.float64)
    for c0 in range(0, L, C):
        kc, vc, dc = k[c0:c0 + C], v[c0:c0 + C], do[c0:c0 + C]
        out[c0:c0 + C] = torch.tril(dc @ vc.T) @ kc + dc @ S
        S = S + vc.T @ kc
    return out


def errors(x, ref):
    whole = ((x.double() - ref).norm() / ref.norm()).item()
    worst = max(((x[c:c + C].double() - ref[c:c + C]).norm() / ref[c:c + C].norm()).item()
                for c in range(0, len(ref), C))
    return f"{whole:.2e} (worst chunk {worst:.2e})"


def run(L, E, seg, dist):
    k, v, do = inputs(L, E, E, dist)
    ref = reference(k, v, do)
    kk, vv, dd = k.float(), v.float(), do.float()
    chunks = list(range(0, L, C))
    # today's dq pass: the forward walk; ends: the state at each segment's end, as the forward keeps
    exact_fwd, rounded_fwd, S, ends = torch.empty(L, E), torch.empty(L, E), torch.zeros(E, E), []
    for c0 in chunks:
        kc, vc, dc = kk[c0:c0 + C], vv[c0:c0 + C], dd[c0:c0 + C]
        P = torch.tril(dc @ vc.T)
        exact_fwd[c0:c0 + C] = P @ kc + dc @ S
        rounded_fwd[c0:c0 + C] = bf(P) @ kc + dc @ copy(S)
        S = S + vc.T @ kc
        if (c0 + C) % seg == 0 or c0 + C >= L:
            ends.append(S.clone())
    exact_rev, rounded_rev = torch.empty(L, E), torch.empty(L, E)
    for si, s0 in enumerate(range(0, L, seg)):
        S, T = ends[si].clone(), -ends[si]
        for c0 in reversed(range(s0, min(s0 + seg, L), C)):
            kc, vc, dc = kk[c0:c0 + C], vv[c0:c0 + C], dd[c0:c0 + C]
            S = S - vc.T @ kc  # 1: the state before the chunk, taken down
            exact_rev[c0:c0 + C] = torch.tril(dc @ vc.T) @ kc + dc @ S
            rounded_rev[c0:c0 + C] = -(dc @ copy(T) + bf(torch.triu(dc @ vc.T, diagonal=1)) @ kc)  # 2
            T = T + vc.T @ kc
    print(f"L={L} E=M={E} segment {seg} {dist}:\n"
          f"  float32 states: built up {errors(exact_fwd, ref)}, taken down {errors(exact_rev, ref)}\n"
          f"  kernels' roundings: today's dq {errors(rounded_fwd, ref)}, reverse {errors(rounded_rev, ref)}; "
          f"dq rounded to bfloat16 {errors(ref.bfloat16(), ref)}")


for L, E, seg in ((2048, 64, 2048), (8192, 64, 2048), (8192, 64, 8192), (32768, 128, 4096), (32768, 128, 32768)):
    for dist in ("normal", "positive"):
        run(L, E, seg, dist)
