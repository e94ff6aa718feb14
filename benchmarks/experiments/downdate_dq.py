# Numerics of dq made in a reverse walk (beside dk and dv) by downdating the prefix state: the
# state before chunk c is the segment end's state minus the later chunks' K^T V. float32 states,
# bfloat16-rounded inputs, against a float64 reference and the forward walk (the dq pass today).
# CPU, seconds: python benchmarks/experiments/downdate_dq.py
import torch

torch.manual_seed(0)


def run(L, E, M, C, seg, dist="normal"):
    k = (torch.randn(L, E) / E**0.5).bfloat16().double()
    v = torch.randn(L, M).bfloat16().double()
    if dist == "positive":  # adversarial: every term adds the same sign, the state grows as L
        k = k.abs(); v = v.abs()
    do = torch.randn(L, M).bfloat16().double()
    # reference dq[t] = sum_{s<=t} (do[t].v[s]) k[s]
    def ref():
        out = torch.empty(L, E, dtype=torch.float64); St = torch.zeros(E, M, dtype=torch.float64)
        for c0 in range(0, L, C):
            kc, vc, dc = k[c0:c0+C], v[c0:c0+C], do[c0:c0+C]
            A = torch.tril(dc @ vc.T)
            out[c0:c0+C] = A @ kc + dc @ St.T
            St = St + kc.T @ vc
        return out
    def forward_walk(dt=torch.float32):
        out = torch.empty(L, E, dtype=dt); St = torch.zeros(E, M, dtype=dt)
        kk, vv, dd = k.to(dt), v.to(dt), do.to(dt)
        for c0 in range(0, L, C):
            kc, vc, dc = kk[c0:c0+C], vv[c0:c0+C], dd[c0:c0+C]
            out[c0:c0+C] = torch.tril(dc @ vc.T) @ kc + dc @ St.T
            St = St + kc.T @ vc
        return out
    def downdate_walk(dt=torch.float32):
        out = torch.empty(L, E, dtype=dt)
        kk, vv, dd = k.to(dt), v.to(dt), do.to(dt)
        # segment ends' states as the forward keeps them (float32, summed forward)
        ends = []; St = torch.zeros(E, M, dtype=dt)
        for c0 in range(0, L, C):
            St = St + kk[c0:c0+C].T @ vv[c0:c0+C]
            if (c0 + C) % seg == 0 or c0 + C >= L: ends.append(St.clone())
        for si, s0 in enumerate(range(0, L, seg)):
            St = ends[si].clone()
            for c0 in reversed(range(s0, min(s0 + seg, L), C)):
                kc, vc, dc = kk[c0:c0+C], vv[c0:c0+C], dd[c0:c0+C]
                St = St - kc.T @ vc  # the state before this chunk
                out[c0:c0+C] = torch.tril(dc @ vc.T) @ kc + dc @ St.T
        return out

    r = ref()
    rel = lambda x: ((x.double() - r).norm() / r.norm()).item()
    # worst chunk's relative error (the early chunks are where downdating loses most)
    def worst(x):
        e = 0.0
        for c0 in range(0, L, C):
            d = (x[c0:c0+C].double() - r[c0:c0+C]).norm() / r[c0:c0+C].norm()
            e = max(e, d.item())
        return e
    f, d = forward_walk(), downdate_walk()
    bf = r.bfloat16().double()
    print(f"L={L} E={E} M={M} seg={seg} {dist:8s}: forward walk {rel(f):.2e} (worst chunk {worst(f):.2e}); "
          f"downdate {rel(d):.2e} (worst chunk {worst(d):.2e}); bf16 rounding of the result {rel(bf):.2e}")
for L, E, seg in ((2048, 64, 2048), (8192, 64, 2048), (8192, 64, 8192), (32768, 128, 4096), (32768, 128, 32768)):
    for dist in ("normal", "positive"):
        run(L, E, E, 64, seg, dist)
