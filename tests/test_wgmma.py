"""The wgmma kernels (csrc/cuda/wgmma_product.cuh: bfloat16 and float16, each pass alone for E and
M up to 256 (the forward and dq; dk and dv as two reverse passes above 128), dk with dv in one pass
up to 128; csrc/cuda/wgmma_tf32_product.cuh: float32's every pass,
E and M up to 256 (above 64 in row and column tiles of 64), float16 heads and tails of scaled tiles,
or the heads alone where TF32 is allowed, normalize too (the forward above 128 in two row tiles);
16-bit normalize: the forward and dq (four atoms on two warpgroups), dk with dv in one pass up to
128, two reverse passes above; no states in or out with packed sequences; on
devices of compute capability 9.0 when the build's arch list
holds 9.0a) against float64 and beside the mma.sync kernels (FAST_CAUSAL_ATTN_WGMMA=0). Elsewhere
these calls take the other kernels and the tests still check the results. The tests that the
kernels are taken where the dispatcher says run where FAST_CAUSAL_ATTN_EXPECT_WGMMA=1 says the
build should have them (benchmarks/gpu_check.sh sets it with TORCH_CUDA_ARCH_LIST=9.0a). The rest
of the suite meets them through conftest's default "cuda" entry."""
import collections
import os
import zlib

import pytest
import torch

import fast_causal_attn
from conftest import CUDA, ON_SM90, SM90, cuda_kernels_launched
from reference import make_inputs, make_state, reference, reference_with_grads, reference_with_state, relative_error
from test_correctness import ERROR_FLOOR, check_against_reference, error_bound, shape_id

EXPECT_WGMMA = pytest.mark.skipif(os.environ.get("FAST_CAUSAL_ATTN_EXPECT_WGMMA") != "1",
                                  reason="FAST_CAUSAL_ATTN_EXPECT_WGMMA=1 says the build holds sm_90a code")


def on_the_wgmma_kernels(test):
    """A test of what the wgmma kernels themselves do (their launches, their instances): CUDA, an
    sm_90 device, and a build that holds their sm_90a code (EXPECT_WGMMA)."""
    return CUDA(SM90(EXPECT_WGMMA(test)))


def output_and_gradients(q, k, v, grad_out):
    """causal_dot_product's output and its gradients into q, k and v for the cotangent grad_out."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fast_causal_attn.causal_dot_product(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


def training_step_kernels(B, H, dtype, L=200, E=64, M=64):
    """The kernels of a forward and backward of a plain call at (B, H, L, E, M)."""
    q, k, v = (x.requires_grad_() for x in make_inputs(B, H, L, E, M, dtype=dtype, device="cuda"))

    with cuda_kernels_launched() as names:
        out = fast_causal_attn.causal_dot_product(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return names


def one_pass_launches(names):
    """Launches of the one-pass backward (wgmma_grad_kv_kernel's kWithDq instances, its fourth
    template argument: dk, dv and dq)."""
    def with_dq(name):
        arguments = name.split("wgmma_grad_kv_kernel<", 1)[1].split(">(", 1)[0].split(", ")
        return arguments[3] == "true"
    return sum(count for n, count in names.items() if "wgmma_grad_kv_kernel<" in n and with_dq(n))


def wgmma_passes(names):
    """The passes of the 16-bit wgmma_product_kernel instances launched ("0" to "3")."""
    return {pass_ for pass_, _, _ in wgmma_instances(names)}


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_training_step_takes_the_wgmma_kernels(dtype, monkeypatch):
    """At any count of (batch, head) pairs (a few, one for each multiprocessor, two for each) the
    forward runs on the wgmma kernel (Pass 0) and dk with dv on its fused reverse pass, with no
    mma.sync kernel; dq beside dk and dv in their pass (one_pass_backward), or with
    FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD=0 on the wgmma kernel (Pass 1); FAST_CAUSAL_ATTN_WGMMA=0
    turns them off."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, H in ((1, 1), (2, 3), (4, 16), (1, sms), (2, sms)):
        names = training_step_kernels(B, H, dtype)
        assert wgmma_passes(names) == {"0"} and one_pass_launches(names) == 1, (B, H, names)
        with monkeypatch.context() as two_passes:
            two_passes.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "0")
            names = training_step_kernels(B, H, dtype)
        assert wgmma_passes(names) == {"0", "1"} and one_pass_launches(names) == 0, (B, H, names)
        assert any("wgmma_grad_kv_kernel" in n for n in names), (B, H, names)
        assert not any("tensorcore_product_kernel" in n for n in names), (B, H, names)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", "0")
    for B, H in ((2, 3), (1, sms)):
        names = training_step_kernels(B, H, dtype)
        assert not any("wgmma" in n for n in names), names
        assert any("tensorcore_product_kernel" in n for n in names), names


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("groups", ["2", "1"], ids=["two-warpgroups", "column-tiles"])
def test_head_dim_128_takes_two_atoms(groups, dtype, monkeypatch):
    """E = M = 128: the forward and dq on the wgmma kernel with A and B in two atoms
    and M on two warpgroups (its template arguments 2, 2), or in column tiles of 64 on one
    (FAST_CAUSAL_ATTN_WGMMA_GROUPS=1: 2, 1); dk and dv on the wide reverse kernel (the state on
    two warpgroups), no mma.sync kernel; and the results within the dtype's bound of float64."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA_GROUPS", groups)
    q, k, v = (x.requires_grad_() for x in make_inputs(4, 16, 200, 128, 128, dtype=dtype, device="cuda"))
    with cuda_kernels_launched() as names:
        out = fast_causal_attn.causal_dot_product(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    taken = {pass_ for pass_, atoms, warpgroups in wgmma_instances(names)
             if (atoms, warpgroups) == (2, int(groups))}
    assert taken == {"0", "1"}, names
    assert any("wgmma_grad_kv_wide_kernel" in n for n in names), names
    assert not any("tensorcore_product_kernel" in n for n in names), names
    check_against_reference(q.detach(), k.detach(), v.detach(), scale=1.0, normalize=False, layout="bhld")


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("shape", [(1, 2, 300, 128, 128), (1, 3, 200, 24, 128), (2, 1, 130, 40, 72),
                                   (1, 2, 150, 256, 136)], ids=shape_id)
def test_16_bit_column_tiles(shape, segments, dtype, monkeypatch):
    """M above 64 in column tiles of 64, one warpgroup each (FAST_CAUSAL_ATTN_WGMMA_GROUPS=1; two
    warpgroups a block is the default, which test_16_bit_plain and test_16_bit_head_dims_above_128
    meet), four atoms of the state's rows on one warpgroup among them: the forward and the three
    gradients within the dtype's bound of float64."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA_GROUPS", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(*shape, dtype=dtype, device="cuda")
    check_against_reference(q, k, v, scale=0.7, normalize=False, layout="bhld")


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
def test_packed_sequences(wgmma, dtype, monkeypatch):
    """Packed sequences (cu_seqlens, without states), one block a sequence on either kernel: each
    sequence's output and dq as float64 gives them, within plain PyTorch's error in the dtype
    (twice, at least ERROR_FLOOR), lengths from empty through partial and whole chunks."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", wgmma)
    lengths = [100, 0, 1, 64, 135]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v = (x.requires_grad_() for x in make_inputs(1, 2, sum(lengths), 64, 48, dtype=dtype, device="cuda",
                                                        layout="blhd"))
    kwargs = dict(scale=0.7, layout="blhd")
    grad_out = torch.randn(1, sum(lengths), 2, 48, device="cuda", dtype=dtype)

    def run():
        out = fast_causal_attn.causal_linear_attention(q, k, v, cu_seqlens=cu_seqlens, **kwargs)
        return out, torch.autograd.grad(out, q, grad_out)[0]

    if os.environ.get("FAST_CAUSAL_ATTN_EXPECT_WGMMA") == "1" and ON_SM90:
        with cuda_kernels_launched() as names:
            run()
        # dk and dv: two passes (run_grad_kv), on mma.sync for packed sequences (wgmma_takes)
        assert wgmma_passes(names) == ({"0", "1"} if wgmma == "1" else set())
    out, grad_q = run()
    for start, stop in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]):
        if stop == start:
            continue
        piece = [x.detach().narrow(1, start, stop - start).requires_grad_() for x in (q, k, v)]
        g = grad_out.narrow(1, start, stop - start)
        for which, got in (("out", out), ("grad_q", grad_q)):
            exact, plain = (reference_with_grads(*piece, g, dtype=d, **kwargs)[0 if which == "out" else 1]
                            for d in (torch.float64, dtype))
            tolerance = error_bound(relative_error(plain, exact), dtype)
            error = relative_error(got.narrow(1, start, stop - start), exact)
            assert error <= tolerance, f"{which}, sequence [{start}, {stop}): {error:.3g} > {tolerance:.3g}"


def check_at_two_scales(q, k, v, layout, normalize=False):
    """The output and gradients at scales 1 and 0.7: within the dtype's bound of float64."""
    for scale in (1.0, 0.7):
        check_against_reference(q, k, v, scale=scale, normalize=normalize, layout=layout)


def check_plain_at_two_scales(shape, layout, segments, wgmma, dtype, monkeypatch):
    """A plain call's output and gradients, on the wgmma kernels or mma.sync (FAST_CAUSAL_ATTN_WGMMA)
    in the given time segments, at scales 1 and 0.7: within the dtype's bound of float64."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", wgmma)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    check_at_two_scales(*make_inputs(*shape, dtype=dtype, device="cuda", layout=layout), layout)


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
@pytest.mark.parametrize("segments", ["1", "3", "8"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 64), (2, 3, 333, 40, 24), (2, 1, 130, 8, 64), (3, 2, 64, 64, 8),
                                   (1, 2, 300, 128, 128), (2, 1, 150, 96, 40), (1, 3, 200, 24, 128)],
                         ids=shape_id)
def test_16_bit_plain(shape, layout, segments, wgmma, dtype, monkeypatch):
    """The forward and the three gradients in 1, 3 or 8 time segments (the state-only launch, the
    scan, the dq pass from the forward's starts, dk and dv from the later segments' sums), whole
    and partial last chunks, E != M, E or M above 64 (the forward and dq in two atoms, on two
    warpgroups; dk and dv on the wide reverse kernel), both layouts, two scales: each within the
    dtype's bound of float64, on the wgmma kernels and on mma.sync."""
    check_plain_at_two_scales(shape, layout, segments, wgmma, dtype, monkeypatch)


def wgmma_instances(names):
    """The 16-bit wgmma_product_kernel instances launched, as (pass, atoms, warpgroups)."""
    found = set()
    for n in names:
        if "wgmma_product_kernel" in n:
            args = n[n.index("Pass)") + 5:].split(">")[0].split(", ")
            found.add((args[0], int(args[2]), int(args[3])))
    return found


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("groups", ["2", "1"], ids=["split-rows", "one-warpgroup"])
def test_head_dims_above_128_take_the_wgmma_kernels(groups, dtype, monkeypatch):
    """E or M above 128: every pass runs alone on wgmma_product_kernel (Pass 0-3; the fused dk/dv
    kernels stop at 128), with the state's rows in four atoms where they pass 128 (by default
    split between two warpgroups, FAST_CAUSAL_ATTN_WGMMA_GROUPS=1 on one; columns in tiles of
    64), and no mma.sync kernel; the results within the dtype's bound. (The plain passes above 128
    take wgmma_transposed_kernel by default: FAST_CAUSAL_ATTN_TRANSPOSED=0 here,
    test_above_128_takes_the_transposed_kernel there.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA_GROUPS", groups)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_TRANSPOSED", "0")
    g = int(groups)
    cases = {
        (256, 256): {("0", 4, g), ("1", 4, g), ("2", 4, g), ("3", 4, g)},
        # forward: Da = E = 64, Dc = M = 256 (two warpgroups on 128 columns); dq and dk: Da = M =
        # 256; dv: Da = 64
        (64, 256): {("0", 1, g), ("1", 4, g), ("2", 4, g), ("3", 1, 1)},
        (200, 96): {("0", 4, g), ("1", 2, g), ("2", 2, 1), ("3", 4, g)},
    }
    for (E, M), expected in cases.items():
        names = training_step_kernels(2, 3, dtype, 300, E, M)
        assert wgmma_instances(names) == expected, (E, M, names)
        assert not any("tensorcore_product_kernel" in n or "grad_kv" in n for n in names), (E, M, names)
        q, k, v = make_inputs(2, 3, 300, E, M, dtype=dtype, device="cuda")
        check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld")
    # at E, M up to 128 FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0 takes the same two reverse passes
    monkeypatch.setenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV", "0")
    monkeypatch.delenv("FAST_CAUSAL_ATTN_WGMMA_GROUPS")
    names = training_step_kernels(2, 3, dtype, 300, 128, 40)
    assert wgmma_instances(names) == {("0", 2, 1), ("1", 1, 2), ("2", 1, 1), ("3", 2, 1)}, names
    assert not any("tensorcore_product_kernel" in n or "grad_kv" in n for n in names), names


def transposed_passes(names):
    """The passes of the wgmma_transposed_kernel instances launched ("0" to "3")."""
    return {n[n.index("Pass)") + 5:].split(">")[0].split(",")[0] for n in names if "wgmma_transposed_kernel" in n}


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_above_128_takes_the_transposed_kernel(dtype, monkeypatch):
    """16-bit, plain, above 128 of a pass's state rows (its Da: E for the forward and dv, M for dq
    and dk), in one time segment: that pass runs on wgmma_transposed_kernel (the state transposed
    in registers, 128 columns a block, bulk tensor copies; float16's copy in one part, its rows
    scaled), the others where they ran (wgmma_product_kernel, as in
    test_head_dims_above_128_take_the_wgmma_kernels), no mma.sync kernel;
    FAST_CAUSAL_ATTN_TRANSPOSED=0, three time segments, a state in or out, or normalize keep them on
    wgmma_product_kernel; the results within the dtype's bound of float64 either way, both layouts,
    partial chunks and atoms (L = 300, E = 200), two scales."""
    cases = {
        (256, 256): ({"0", "1", "2", "3"}, set()),
        # forward: Da = E = 64 (one atom, M = 256 on two warpgroups); dq and dk: Da = M = 256; dv: Da = E = 64
        (64, 256): ({"1", "2"}, {("0", 1, 2), ("3", 1, 1)}),
        (200, 96): ({"0", "3"}, {("1", 2, 2), ("2", 2, 1)}),
    }
    for (E, M), (transposed, product) in cases.items():
        names = training_step_kernels(2, 3, dtype, 300, E, M)
        assert transposed_passes(names) == transposed and wgmma_instances(names) == product, (E, M, names)
        assert not any("tensorcore_product_kernel" in n or "grad_kv" in n for n in names), (E, M, names)
        for layout in ("bhld", "blhd"):
            q, k, v = make_inputs(2, 3, 300, E, M, dtype=dtype, device="cuda", layout=layout)
            for scale in (1.0, 0.7):
                check_against_reference(q, k, v, scale=scale, normalize=False, layout=layout)
    q, k, v = (x.requires_grad_() for x in make_inputs(2, 3, 300, 256, 256, dtype=dtype, device="cuda"))
    with cuda_kernels_launched() as names:  # a state out: the four-atom kernel
        fast_causal_attn.causal_linear_attention(q, k, v, return_final_state=True)
    assert not transposed_passes(names) and wgmma_instances(names) == {("0", 4, 2)}, names
    qn, kn, vn = make_inputs(2, 3, 300, 256, 256, dtype=dtype, device="cuda", normalize=True)
    with cuda_kernels_launched() as names:  # normalize: the four-atom kernel
        fast_causal_attn.causal_linear_attention(qn, kn, vn, normalize=True)
    assert not transposed_passes(names), names
    for switch, value in (("FAST_CAUSAL_ATTN_TRANSPOSED", "0"), ("FAST_CAUSAL_ATTN_SEGMENTS", "3")):
        with monkeypatch.context() as m:
            m.setenv(switch, value)
            names = training_step_kernels(2, 3, dtype, 300, 256, 256)
            assert not transposed_passes(names), (switch, names)
            assert wgmma_instances(names) == {("0", 4, 2), ("1", 4, 2), ("2", 4, 2), ("3", 4, 2)}, (switch, names)


def keeping_forward(q, k, v, kv0=None, k_sum0=None, normalize=False):
    """The forward op's results with its segments kept (keep_segments), bhld, scale 1."""
    return torch.ops.fast_causal_attn.forward(q, k, v, kv0, k_sum0, None, 1.0, normalize, 1e-6, "bhld", False, True)


def kept_segments(q, k, v, kv0=None, k_sum0=None, normalize=False):
    """The forward op's kept segments (their starts, or their ends for the one-pass backward)."""
    return keeping_forward(q, k, v, kv0, k_sum0, normalize)[4]


def segment_ends(k, v, kv0, count):
    """The state sum k^T v at each of `count` time segments' ends (the kernels' split of L into
    segments of whole 64-step chunks, segment_length in csrc/cuda/kernel_common.cuh), from kv0 (or
    zeros), in float64: [B * H, count, E, M]."""
    B, H, L, E = k.shape
    length = -(-(-(-L // count)) // 64) * 64  # ceil(ceil(L / count) / 64) * 64
    kv = torch.zeros(B, H, E, v.shape[-1], dtype=torch.float64, device=k.device) if kv0 is None else kv0.double()
    ends, begin = [], 0
    for j in range(count):
        end = min((j + 1) * length, L)
        kv = kv + k[:, :, begin:end].double().transpose(-1, -2) @ v[:, :, begin:end].double()
        ends.append(kv)
        begin = end
    return torch.stack(ends, dim=2).flatten(0, 1)


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_pass_backward_where_the_forward_kept_its_ends(dtype, monkeypatch):
    """The forward keeps its time segments' ends for the one-pass backward (16-bit, E and M up to
    64; one_pass_backward) in place of their starts, at any pair count, in one
    segment or many (the plan's count too; above 16 the one pass's segments span several, where
    they fill half the multiprocessors, else the starts and two passes): each
    the initial state plus k^T v up to the segment's end, within float32's rounding of float64; and
    the backward then runs the one pass (dq beside dk and dv: no dq pass; its results:
    test_one_pass_backward); under normalize the key sum's ends beside. Not with
    FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD=0 (the segments' starts, for the dq pass), nor with E above 64."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def check_ends(B, H, L, E=64, M=64, with_state=False):
        q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda")
        kv0, k_sum0 = (torch.randn(B, H, E, M, device="cuda"), torch.randn(B, H, E, device="cuda")) if with_state \
            else (None, None)
        kept = kept_segments(q, k, v, kv0, k_sum0)
        assert kept.shape[0] == B * H and kept.shape[1] >= 1 and kept.shape[2:] == (E, M), kept.shape
        exact = segment_ends(k, v, kv0, kept.shape[1])
        assert relative_error(kept, exact) <= 1e-5, (B, H, L, E, M, kept.shape)
        names = training_step_kernels(B, H, dtype, L, E, M)  # (many segments: a state-only launch of it too)
        assert one_pass_launches(names) >= 1 and wgmma_passes(names) == {"0"}, (B, H, L, E, M, names)
        return kept.shape[1]

    assert check_ends(1, sms, 300) == 1
    assert check_ends(2, 3, 2048, with_state=True) > 1  # few pairs: the forward in segments
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "3")
    assert check_ends(2, 3, 300, 40, 24, with_state=True) == 3
    assert check_ends(1, 2, 4100, 64, 48) == 3
    # above 16 segments (18 of 1100 steps) the one pass's each span two (9 in one launch), where
    # its blocks fill at least half the multiprocessors (keeps_one_pass_ends): 2 * pairs * 9 >= sms
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "20")
    assert check_ends(-(-sms // 36), 2, 1100, 64, 48, with_state=True) == 18
    # with fewer pairs (17 of 4100 steps at 2) the starts, for the two passes
    q, k, v = make_inputs(1, 2, 4100, 64, 64, dtype=dtype, device="cuda")
    starts = kept_segments(q, k, v)
    assert starts.shape[1] == 17, starts.shape
    assert relative_error(starts[:, 1:], segment_ends(k, v, None, 17)[:, :-1]) <= 1e-5
    names = training_step_kernels(1, 2, dtype, 4100)
    assert one_pass_launches(names) == 0 and wgmma_passes(names) == {"0", "1"}, names
    monkeypatch.delenv("FAST_CAUSAL_ATTN_SEGMENTS")
    assert kept_segments(*make_inputs(1, sms, 300, 128, 64, dtype=dtype, device="cuda")).shape[1] == 0  # E above 64
    # under normalize the key sum's ends beside the state's (dq's extra row), the one pass in three
    # launches (its state-only blocks and the scan): bfloat16's default, float16's where =1 asks
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "3")
    q, k, v = make_inputs(2, 3, 300, 40, 24, dtype=dtype, device="cuda", normalize=True)
    kv0, k_sum0 = torch.randn(2, 3, 40, 24, device="cuda"), torch.rand(2, 3, 40, device="cuda") * 3
    kept, kept_key_sums = keeping_forward(q, k, v, kv0, k_sum0, normalize=True)[4:6]
    assert kept.shape[1] == 3 and kept_key_sums.shape == (6, 3, 40), (kept.shape, kept_key_sums.shape)
    assert relative_error(kept, segment_ends(k, v, kv0, 3)) <= 1e-5
    ones = torch.ones(2, 3, 300, 1, dtype=dtype, device="cuda")  # k^T 1: the key sums
    exact_key_sums = segment_ends(k, ones, k_sum0.unsqueeze(-1), 3).squeeze(-1)
    assert relative_error(kept_key_sums, exact_key_sums) <= 1e-5
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with cuda_kernels_launched() as names:
        out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
        torch.autograd.grad(out.float().sum(), (q, k, v))
    assert one_pass_launches(names) >= 1 and wgmma_passes(names) == {"0"}, names
    # (dO . O: its producer makes them in one segment alone, one_pass_makes_dots)
    assert any("backward_prepare" in n for n in names), names
    monkeypatch.delenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD")
    for segments in ("3", "1"):  # by default float16 runs the two passes in segments, the one pass in one
        monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
        with cuda_kernels_launched() as names:
            out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
            torch.autograd.grad(out.float().sum(), (q, k, v))
        one_pass = dtype == torch.bfloat16 or segments == "1"
        assert (one_pass_launches(names) >= 1) == one_pass, (segments, names)
        assert wgmma_passes(names) == ({"0"} if one_pass else {"0", "1"}), (segments, names)
        # dO . O by the one pass's producer in one segment, by the dq pass's producer in the two passes
        # (one column tile), by backward_prepare_kernel for the one pass in segments
        prepared = one_pass and segments == "3"
        assert any("backward_prepare" in n for n in names) == prepared, (segments, names)
    monkeypatch.delenv("FAST_CAUSAL_ATTN_SEGMENTS")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "0")
    q, k, v = make_inputs(2, 3, 2048, 64, 64, dtype=dtype, device="cuda")
    starts = kept_segments(q, k, v)
    count = starts.shape[1]
    assert count > 1
    # the starts: the ends shifted one segment on, the first zeros
    ends = segment_ends(k, v, None, count)
    assert relative_error(starts[:, 1:], ends[:, :-1]) <= 1e-5 and starts[:, 0].abs().max() == 0
    names = training_step_kernels(2, 3, dtype, 2048)
    assert one_pass_launches(names) == 0 and wgmma_passes(names) == {"0", "1"}, names


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments", ["1", "3", "3-three-launches", "20"])
@pytest.mark.parametrize("backward", ["one-pass", "two-passes"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 64), (2, 3, 333, 40, 24), (2, 1, 130, 8, 64), (3, 2, 64, 64, 8),
                                   (1, 1, 64, 64, 64), (2, 2, 4100, 64, 64)], ids=shape_id)
def test_one_pass_backward(shape, layout, backward, segments, dtype, monkeypatch):
    """The one-pass backward in the forward's time segments, 1 or 3 (one launch: D's starts by
    look-back, the dq warpgroup idle through the summing walk), 3 in three launches
    (FAST_CAUSAL_ATTN_ONE_LAUNCH=0: the state-only launch of the same kernel, the scan, the pass)
    or 20 asked (as many as there are chunks; 17 at 4100 steps, where the 4 pairs are too few
    for the one pass in 9 segments of two each, keeps_one_pass_ends: two passes, from the starts;
    that one pass: test_one_pass_backward_spanning_the_forwards_segments): dq from the state
    taken down from its segment's end, whole and partial last chunks, a sequence of one chunk, E != M, both layouts,
    two scales; and the two passes it replaces (FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD=0: dq from the
    forward's segment starts, dk with dv): the output and each gradient within the dtype's bound
    of float64 (check_against_reference). (test_one_pass_backward_where_the_forward_kept_its_ends
    counts the launches: not here, where the sanitizer subset runs it, under which the profiler
    sees no kernels.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "1" if backward == "one-pass" else "0")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments.split("-")[0])
    if segments.endswith("three-launches"):
        monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", "0")
    q, k, v = make_inputs(*shape, dtype=dtype, device="cuda", layout=layout)
    check_at_two_scales(q, k, v, layout)


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_one_pass_backward_spanning_the_forwards_segments(layout, normalize, dtype, monkeypatch):
    """20 segments asked at 1100 steps: the forward runs in 18 (one a chunk, the last partial) and
    keeps their ends, and the one pass runs in 9 of two each (one_pass_span: dq's state taken down
    from the end of the second of its forward segments), with enough pairs that its blocks fill half
    the multiprocessors (keeps_one_pass_ends), plain and normalized (three launches there: the
    state-only blocks and the scan): the kept ends within float32's rounding of float64, and the
    output and each gradient within the dtype's bound of float64, at two scales. (Its
    launches are counted in test_one_pass_backward_where_the_forward_kept_its_ends, not here: the
    sanitizer subset runs this test, and the profiler sees no kernels under it.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "20")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shape = (-(-sms // 36), 2, 1100, 64, 48)
    q, k, v = make_inputs(*shape, dtype=dtype, device="cuda", layout=layout, normalize=normalize)
    qb, kb, vb = (x.transpose(1, 2).contiguous() if layout == "blhd" else x for x in (q, k, v))
    kept = kept_segments(qb, kb, vb, normalize=normalize)
    assert kept.shape[1] == 18, kept.shape
    assert relative_error(kept, segment_ends(kb, vb, None, 18)) <= 1e-5  # the ends, not the starts
    check_at_two_scales(q, k, v, layout, normalize)


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments", ["1", "3", "20"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 64), (2, 3, 333, 40, 24), (3, 2, 64, 64, 8), (1, 1, 64, 64, 64)],
                         ids=shape_id)
def test_normalized_one_pass_backward(shape, layout, segments, dtype, monkeypatch):
    """The one-pass backward under normalize: dq's extra row (a = -dO . O added to each kept score
    of U, a times minus the key sum taken down from the forward's kept end added to each row, each
    row times -scale / den) beside dk's (e, q / den), in one segment, in three (three launches: its
    state-only blocks and the scan; the normalized backward has no one launch) or 20 asked (as many as there
    are chunks, up to 16), whole and partial last chunks, a sequence of one chunk, E != M, both
    layouts, two scales: the output and each gradient within the dtype's bound of float64
    (check_at_two_scales). (Its launches: test_one_pass_backward_where_the_forward_kept_its_ends;
    the sanitizer subset runs this test.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(*shape, dtype=dtype, device="cuda", layout=layout, normalize=True)
    check_at_two_scales(q, k, v, layout, normalize=True)


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("scale", [0.7, 2.0**40], ids=["0.7", "2^40"])
@pytest.mark.parametrize("shape", [(2, 2, 300, 64, 64), (1, 3, 200, 40, 24)], ids=shape_id)
def test_one_pass_backward_with_states(shape, scale, segments, normalize, dtype, monkeypatch):
    """The one-pass backward from a given state with the final state out (the forward's segment
    ends, from which dq's state is taken down, hold the initial state; dk and dv start from the
    final state's gradient and end at the initial one's; the key sum's gradient passes through,
    or under normalize runs from the final key sum's to the initial one's in dk's extra row, and
    dq's extra row starts from the key sum's kept end), the forward in one segment or three: every
    result within its bound (check_state_call); and it ran. At scale 2^40, where a given final
    state's gradient keeps it off after all (wgmma_takes: |scale| outside [2^-32, 2^32]), the two
    passes run from the forward's kept ends, dq summing its own segments, with dO . O made for them
    under normalize (the one pass was to make them): bfloat16 alone there (2^40 q leaves float16's
    range, the plain reference's too)."""
    if scale > 1 and dtype == torch.float16:
        pytest.skip("2^40 q leaves float16's range (the plain reference's too)")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    B, H, L, E, M = shape
    gen = torch.Generator().manual_seed(
        zlib.crc32(repr((shape, scale, segments, dtype, normalize, "one pass")).encode()))
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", normalize=normalize, generator=gen)
    with cuda_kernels_launched() as names:
        check_state_call(q, k, v, list(make_state(B, H, E, M, dtype, normalize)), (B, H, E, M), gen,
                         lambda q, k, v, s: states_step(q, k, v, s or None, "bhld", scale, normalize=normalize),
                         lambda q, k, v, s, **kw: reference_with_state(q, k, v, s or None, scale=scale,
                                                                       normalize=normalize, layout="bhld", **kw),
                         exact_in_float32={"final kv", "final k_sum"})
    fell_back = scale > 1
    assert (one_pass_launches(names) >= 1) != fell_back and ("1" in wgmma_passes(names)) == fell_back, names


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dv_when_the_forward_ran_in_segments_and_dk_did_not(dtype):
    """E = 256, M = 64, 4 x 16 pairs at the default segments: the forward (64 blocks) runs in time
    segments and keeps their starts for dq, dk (four column tiles of E: 256 blocks) runs whole, and
    dv, which reads dk's starts where dk keeps them, must not read the forward's (it did, and its
    relative error was 1.0: H200, twenty-fifth session)."""
    names = training_step_kernels(4, 16, dtype, 2048, 256, 64)
    assert wgmma_instances(names) == {("0", 4, 2), ("1", 1, 2), ("2", 1, 1), ("3", 4, 2)}, names
    q, k, v = make_inputs(4, 16, 2048, 256, 64, dtype=dtype, device="cuda")
    kept = kept_segments(q, k, v)
    assert kept.shape[1] > 1, kept.shape  # the forward in segments
    check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld")


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(1, 2, 300, 256, 256), (2, 1, 130, 256, 40), (1, 2, 200, 72, 256),
                                   (1, 1, 100, 136, 200)], ids=shape_id)
def test_16_bit_head_dims_above_128(shape, layout, segments, wgmma, dtype, monkeypatch):
    """E or M above 128 (four atoms of the state's rows; dk and dv as two reverse passes, dv from
    dk's segment starts) in 1 or 3 time segments, partial chunks and partial atoms (136, 200),
    E != M, both layouts, two scales: within the dtype's bound of float64, on wgmma and mma.sync."""
    check_plain_at_two_scales(shape, layout, segments, wgmma, dtype, monkeypatch)


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("segments", ["1", "3", "8"])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 64), (2, 3, 333, 40, 24), (1, 2, 300, 128, 128),
                                   (2, 1, 150, 96, 40)], ids=shape_id)
def test_16_bit_two_reverse_passes(shape, segments, dtype, normalize, monkeypatch):
    """FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0 at E, M up to 128: dk and dv as the two reverse passes of
    wgmma_product_kernel (as above 128; test_head_dims_above_128_take_the_wgmma_kernels and
    test_normalized_two_reverse_passes_take_the_wgmma_kernel check that they run) in place of the
    fused pass, dv from dk's segment starts in segments (under normalize its own state-only
    launch): within the dtype's bound of float64, as the fused pass; normalized, dk's extra row and
    q / den as the fused pass's."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV", "0")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(*shape, dtype=dtype, device="cuda", layout="blhd", normalize=normalize)
    check_against_reference(q, k, v, scale=0.7, normalize=normalize, layout="blhd")


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_normalized_two_reverse_passes_take_the_wgmma_kernel(dtype, monkeypatch):
    """Under normalize, FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0 at E, M up to 128 runs dk and dv as the
    two reverse passes of wgmma_product_kernel's normalized instances (one warpgroup at one or two
    atoms) beside the forward's and dq's, and no mma.sync kernel."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV", "0")
    q, k, v = (x.requires_grad_() for x in make_inputs(2, 3, 300, 128, 40, dtype=dtype, device="cuda", normalize=True))
    with cuda_kernels_launched() as names:
        out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
        torch.autograd.grad(out.float().sum(), (q, k, v))
    assert wgmma_instances(names) == {("0", 2, 1), ("1", 1, 2), ("2", 1, 1), ("3", 2, 1)}, names
    assert not any("tensorcore_product_kernel" in n or "grad_kv" in n for n in names), names


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("shape", [(2, 2, 300, 64, 64), (1, 2, 333, 128, 40), (2, 1, 150, 40, 96)], ids=shape_id)
def test_normalized_two_reverse_passes_with_states(shape, segments, dtype, monkeypatch):
    """Normalized, FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0: dk's extra row from the final key sum's
    gradient to the initial one's (e through the segments' sums and scan) and dv's state from the
    final state's gradient to the initial one's, on the two reverse passes at one and two atoms,
    from a given state with the final state out, scale 0.7 (check_state_call, as
    test_normalized_forward_on_the_wgmma_kernels)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV", "0")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    B, H, L, E, M = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, segments, dtype, "two passes")).encode()))
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", normalize=True, generator=gen)
    check_state_call(q, k, v, list(make_state(B, H, E, M, dtype, True)), (B, H, E, M), gen,
                     lambda q, k, v, s: states_step(q, k, v, s or None, "bhld", 0.7, normalize=True),
                     lambda q, k, v, s, **kw: reference_with_state(q, k, v, s or None, scale=0.7, normalize=True,
                                                                   layout="bhld", **kw),
                     exact_in_float32={"final kv", "final k_sum"})


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
@pytest.mark.parametrize("width", [64, 128])
def test_16_bit_plain_unaligned_rows(width, wgmma, dtype, monkeypatch):
    """Rows that do not start at 16-byte boundaries (a view one element in) are copied into aligned
    ones by the ops: the same results, E = M = 64 and 128 (two atoms; dk and dv on the wide
    kernel)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", wgmma)
    q, k, v = (torch.randn(2, 3, 200, width + 1, device="cuda", dtype=dtype)[..., 1:] / 8 for _ in range(3))
    check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld")


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_unaligned_rows_take_the_wgmma_kernels(dtype):
    """The wgmma kernels stage and store whole 16-byte rows only; rows off 16-byte boundaries (a
    view one element in) are copied into aligned ones by the ops, so a training step on them still
    runs every pass there, with no other product kernel."""
    q, k, v = (torch.randn(2, 3, 200, 65, device="cuda", dtype=dtype)[..., 1:].requires_grad_() for _ in range(3))
    assert all(x.data_ptr() % 16 != 0 for x in (q, k, v))
    with cuda_kernels_launched() as names:
        out = fast_causal_attn.causal_dot_product(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    products = [n for n in names if "product_kernel" in n or "grad_kv" in n]
    assert products and all("wgmma" in n for n in products), names


@on_the_wgmma_kernels
def test_forward_segments_fill_two_blocks_a_multiprocessor_where_long(monkeypatch):
    """The wgmma forward at E, M <= 64 fits two blocks a multiprocessor: where filling the
    multiprocessors once takes 16 segments or more (a sixteenth as many pairs as multiprocessors),
    it takes twice as many while each holds 8 chunks or more (16384 steps: 32 of 8 chunks), and no
    more than one wave's where they would be shorter (4096 steps: 16 of 4 chunks); where one wave
    takes fewer, as many as that (a quarter as many pairs: 4; wgmma_segments). The result is right
    either way. (The count of the segments' starts, kept for the two-pass backward: the one pass,
    which keeps their ends, is off here.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert sms >= 64, sms  # (the counts below take 4 to 8 pairs)
    few, quarter = sms // 16, sms // 4
    for pairs, L, expected in ((few, 16384, 32), (few, 4096, 16), (quarter, 4096, sms // quarter)):
        q, k, v = make_inputs(1, pairs, L, 64, 64, dtype=torch.bfloat16, device="cuda")
        results = keeping_forward(q, k, v)
        assert results[4].shape[1] == expected, (L, results[4].shape)
        # against the quadratic reference on the GPU, over the first two heads (all eight at 16384
        # steps would take 34 GB of float64 scores)
        q, k, v, out = (x[:, :2] for x in (q, k, v, results[0]))
        exact, plain = (reference(q, k, v, dtype=dtype) for dtype in (torch.float64, torch.bfloat16))
        assert relative_error(out, exact) <= error_bound(relative_error(plain, exact), torch.bfloat16)


def kernel_launches(run):
    """run()'s result, and how many times each CUDA kernel launched in it (cuda_kernels_launched)."""
    with cuda_kernels_launched() as launches:
        result = run()
    return result, launches


def launches_of(counts, part):
    """How many launches of the kernels whose name holds `part` a kernel_launches count holds."""
    return sum(c for n, c in counts.items() if part in n)


def forward_launches(q, k, v, kv0=None, k_sum0=None, normalize=False):
    """The forward op's kernels (name -> launches) and its results, with its segments kept
    (keeping_forward)."""
    results, counts = kernel_launches(lambda: keeping_forward(q, k, v, kv0, k_sum0, normalize))
    return counts, results


def set_switch(monkeypatch, name, value):
    """An environment switch set to value, or cleared (the default) where value is None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def max_relative_difference(a, b):
    """The largest |a - b| over the largest |b|: two ways of summing the same segments agree to
    float32 rounding where this is below 1e-5."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments", ["3", "64"])
@pytest.mark.parametrize("shape", [(2, 4, 4096, 64, 64), (1, 2, 4100, 64, 48), (1, 2, 4100, 128, 128)], ids=shape_id)
def test_one_launch_segments(shape, segments, dtype, monkeypatch):
    """The 16-bit forward in time segments runs in one launch (KernelParams::lookback: each block
    sums its segment, publishes the sum and starts from the sums before it), with no state-only
    launch and no scan, where FAST_CAUSAL_ATTN_ONE_LAUNCH=0 runs the three launches; its kept
    segment starts (the dq pass's) are the three launches' to float32 rounding; dk with dv (one
    pass, in reverse) runs in one launch too, and a fwd+bwd scans nothing. By default only at E
    and M up to 64 and 2 to 16 segments (one_launch_segments' crossover); =1 at any count, still
    only at E and M up to 64 (E = M = 128 has no one-launch instance: three launches however
    asked). The output and gradients are within the dtype's bound of float64 either way. 64
    segments: more blocks (8 pairs x 64) than the device holds at once, so that blocks wait on
    blocks that started before them only (the order they start in, not their index)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(*shape, dtype=dtype, device="cuda")
    has_one_launch = max(shape[3:]) <= 64
    products = lambda counts: launches_of(counts, "wgmma_product_kernel")  # noqa: E731
    scans = lambda counts: any("scan_segments" in n for n in counts)  # noqa: E731
    default, _ = forward_launches(q, k, v)
    by_default = has_one_launch and int(segments) <= 16
    assert products(default) == (1 if by_default else 2) and scans(default) != by_default, default
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", "1")
    one, (out_one, *rest_one) = forward_launches(q, k, v)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", "0")
    three, (out_three, *rest_three) = forward_launches(q, k, v)
    assert products(one) == (1 if has_one_launch else 2) and scans(one) != has_one_launch, one
    assert products(three) == 2 and scans(three), three
    starts_one, starts_three = rest_one[3], rest_three[3]
    assert starts_one.shape == starts_three.shape and starts_one.shape[1] > 1, starts_one.shape
    assert max_relative_difference(starts_one, starts_three) < 1e-5
    exact = reference(q, k, v, dtype=torch.float64)
    plain = reference(q, k, v, dtype=dtype)
    bound = error_bound(relative_error(plain, exact), dtype)
    assert relative_error(out_one, exact) <= bound and relative_error(out_three, exact) <= bound
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", "1")
    if has_one_launch:  # dk with dv in one pass (wgmma_grad_kv_kernel): one launch too
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def step():
            out = fast_causal_attn.causal_dot_product(*leaves)
            torch.autograd.grad(out, leaves, torch.randn_like(out))

        _, names = kernel_launches(step)
        assert launches_of(names, "grad_kv") == 1 and not scans(names), names
    check_against_reference(q, k, v, scale=0.7, normalize=False, layout="bhld")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", "0")
    check_against_reference(q, k, v, scale=0.7, normalize=False, layout="bhld")


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state", ["zero", "given"])
@pytest.mark.parametrize("segments", ["3", "64"])
def test_normalized_forward_in_one_launch(segments, state, dtype, monkeypatch):
    """Under normalize the 16-bit forward in time segments runs in one launch too (E and M up to
    64): each block publishes its segment's key sums beside its state's and starts from the sums
    of the segments before it and the given start, with no state-only launch and no scan, where
    FAST_CAUSAL_ATTN_ONE_LAUNCH=0 runs the three launches. What it keeps for the backward, the
    segments' starts (the state's and the key sums', without the given start) or, for the one
    pass, their ends, is the three launches' to float32 rounding, and the output is within the
    dtype's bound of float64 either way. 64 segments: blocks wait on blocks that started before
    them only. (The launches are counted in test_normalized_launches, not here: the
    sanitizer subset runs this test, and the profiler sees no kernels under it.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    B, H, L, E, M = 2, 3, 4100, 64, 48
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", normalize=True)
    given = [torch.randn(B, H, E, M, device="cuda"), torch.rand(B, H, E, device="cuda") * 3] if state == "given" \
        else None
    exact, plain = (reference_with_state(q, k, v, given, normalize=True, dtype=d)[0] for d in (torch.float64, dtype))
    bound = error_bound(relative_error(plain, exact), dtype)
    for one_pass in ("0", "1"):  # (the starts kept, or the ends: bfloat16's one pass; float16's where =1 asks)
        monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", one_pass)
        results = {}
        for one_launch in ("1", "0"):
            monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", one_launch)
            results[one_launch] = keeping_forward(q, k, v, *(given or (None, None)), normalize=True)
            assert relative_error(results[one_launch][0], exact) <= bound, (one_pass, one_launch)
        for kept_one, kept_three in zip(results["1"][4:6], results["0"][4:6]):  # the state's, the key sums'
            assert kept_one.shape == kept_three.shape and kept_one.shape[1] > 1, kept_one.shape
            assert max_relative_difference(kept_one, kept_three) < 1e-5, one_pass


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state", ["none", "given"])
@pytest.mark.parametrize("segments", ["3", "64"])
def test_normalized_grad_kv_in_one_launch(segments, state, dtype, monkeypatch):
    """Under normalize dk with dv in one pass (the backward's two passes: FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD=0)
    in time segments runs in one launch too (E and M up to 64): each block publishes its segment's
    extra-row sums beside its D's and starts from those of the segments after it, the last first,
    and the given start's (the final key sum's gradient), where FAST_CAUSAL_ATTN_ONE_LAUNCH=0 runs
    the three launches (heads and tails). The output and every gradient within their bounds of
    float64 either way: from no state (check_against_reference) or from a given one with the final
    state out (check_normalized_state_call). 64 segments: blocks wait on blocks that started
    before them only. (The launches are counted in test_normalized_launches: the sanitizer subset
    runs this test.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", "0")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    shape, seed_key = (2, 3, 4100, 64, 48), (segments, state, dtype, "grad_kv one launch")
    for one_launch in ("1", "0"):  # (the same inputs both ways: one seed)
        monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", one_launch)
        if state == "given":
            check_normalized_state_call(shape, seed_key, dtype=dtype)
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(repr(seed_key).encode()))
        q, k, v = make_inputs(*shape, dtype=dtype, device="cuda", normalize=True, generator=gen)
        check_against_reference(q, k, v, scale=0.7, normalize=True, layout="bhld")


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments", ["3", "64"])
def test_normalized_launches(segments, dtype, monkeypatch):
    """The launches of test_normalized_forward_in_one_launch's calls: one wgmma_product_kernel and
    no scan where FAST_CAUSAL_ATTN_ONE_LAUNCH=1, the state-only launch, the pass and the scans
    where =0, keeping the starts or (the one pass) the ends; and by default one launch at 3
    segments, three at 64 (above 16: one_launch_segments). Those of
    test_normalized_grad_kv_in_one_launch's backward (the two passes): dk with dv in one launch of
    wgmma_grad_kv_kernel and no scan in the whole step where =1 (dq reads the forward's kept
    starts), two and the scans where =0; the normalized one pass (at 3 segments) in three launches
    however asked. By default dk with dv takes three where their state-only blocks run in heads
    that save an eighth of a segment or more (one_launch_segments: here heads of 11 of 3 segments'
    22 chunks), one where they run in whole segments (FAST_CAUSAL_ATTN_TC_STATE_HEAD=0), and three
    at 64 segments either way."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(2, 3, 4100, 64, 48, dtype=dtype, device="cuda", normalize=True)
    given = [torch.randn(2, 3, 64, 48, device="cuda"), torch.rand(2, 3, 64, device="cuda") * 3]
    for one_pass in ("0", "1"):
        monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", one_pass)
        for one_launch in ("1", "0", None):
            set_switch(monkeypatch, "FAST_CAUSAL_ATTN_ONE_LAUNCH", one_launch)
            three = one_launch == "0" or (one_launch is None and segments == "64")
            names = forward_launches(q, k, v, *given, normalize=True)[0]
            assert launches_of(names, "wgmma_product_kernel") == (2 if three else 1), (one_pass, one_launch, names)
            assert any("scan_segments" in n for n in names) == three, (one_pass, one_launch, names)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        out = fast_causal_attn.causal_linear_attention(*leaves, normalize=True)
        torch.autograd.grad(out.float().sum(), leaves)

    for one_pass in ("0", "1") if segments == "3" else ("0",):  # (at 64 the one pass would span segments)
        monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD", one_pass)
        for one_launch, head in (("1", None), ("0", None), (None, None), (None, "0")):
            set_switch(monkeypatch, "FAST_CAUSAL_ATTN_ONE_LAUNCH", one_launch)
            set_switch(monkeypatch, "FAST_CAUSAL_ATTN_TC_STATE_HEAD", head)
            names = kernel_launches(step)[1]
            by_default_three = segments == "64" or head is None
            three = one_launch == "0" or one_pass == "1" or (one_launch is None and by_default_three)
            assert (one_pass_launches(names) >= 1) == (one_pass == "1"), (one_pass, one_launch, head, names)
            assert launches_of(names, "wgmma_grad_kv_kernel") == (2 if three else 1), (one_pass, one_launch, head, names)
            assert any("scan_segments" in n for n in names) == three, (one_pass, one_launch, head, names)


@on_the_wgmma_kernels
@pytest.mark.parametrize("segments", ["8", "16"])
def test_one_launch_segments_under_graph_capture(segments, monkeypatch):
    """A call captured into a CUDA graph replays without the host's cost of issuing it, so that
    only the GPU's time decides (one_launch_segments): a forward and backward captured at 9 to 16
    segments take the three launches (the state-only launch, the scan, the pass), where an eager
    call takes one launch, and at 8 one launch either way (the backward is the one pass: dk, dv
    and dq in its kernel, no dq pass). The replay's output and gradients are the eager call's to
    bfloat16 rounding (the two ways' starts agree to float32 rounding)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(2, 4, 4096, 64, 64, dtype=torch.bfloat16, device="cuda")
    grad_out = torch.randn_like(v)

    def step(leaves):  # (out detached, and leaves of its own for the eager call: a kept graph
        # would keep the leaves' AccumulateGrad nodes, and the stream they were made on, the
        # default one, which a capture must not wait on: pytorch/pytorch#164302; the capture's
        # first try failed so)
        out = fast_causal_attn.causal_dot_product(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))

    def new_leaves():
        return [x.detach().clone().requires_grad_() for x in (q, k, v)]

    eager, eager_counts = kernel_launches(lambda: step(new_leaves()))
    leaves = new_leaves()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch.cuda.graphs asks
        step(leaves)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(leaves)
    _, replay_counts = kernel_launches(graph.replay)
    three = segments == "16"
    assert launches_of(eager_counts, "scan_segments") == 0, eager_counts
    assert launches_of(eager_counts, "grad_kv") == 1, eager_counts
    # (the forward; dq beside dk and dv: the one-pass backward)
    assert launches_of(eager_counts, "wgmma_product_kernel") == 1, eager_counts
    assert launches_of(replay_counts, "scan_segments") == (2 if three else 0), replay_counts
    assert launches_of(replay_counts, "grad_kv") == (2 if three else 1), replay_counts
    assert launches_of(replay_counts, "wgmma_product_kernel") == (2 if three else 1), replay_counts
    for name, x, y in zip(("out", "grad_q", "grad_k", "grad_v"), captured, eager):
        assert relative_error(x, y) <= ERROR_FLOOR[torch.bfloat16], name


def tf32_arguments(name):
    """A float32 wgmma kernel's template arguments after its pass: [pass, heads and tails, parts,
    normalize], as the demangled name spells them."""
    return name[name.index("Pass)") + 5:].split(">")[0].split(", ")


def tf32_kernels(names):
    """The float32 wgmma kernels launched, as (pass, heads and tails) pairs."""
    return {(a[0], a[1] == "true") for a in map(tf32_arguments, (n for n in names if "wgmma_tf32_product_kernel" in n))}


@on_the_wgmma_kernels
@pytest.mark.parametrize("allow_tf32", [False, True], ids=["exact", "tf32-allowed"])
def test_float32_takes_the_wgmma_kernels(allow_tf32, monkeypatch):
    """float32 at E = M = 64: at any count of pairs and length every pass runs on the float32 wgmma
    kernel (the forward, dq, and dk and dv as two reverse passes: Pass 0-3; 2048 steps on 6 pairs
    in time segments), heads and tails, or the heads alone where the user allowed TF32 (torch's flag), no mma.sync
    kernel; FAST_CAUSAL_ATTN_WGMMA=0 turns it off. At E = M = 128, and at E = 128 with M = 64, every
    pass runs on it too (the state's rows in two row tiles, their outputs summed), and so it does
    above 128 (up to four row tiles: 256, 200 with a partial one, 136 with three)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allow_tf32)
    for B, H, L in ((1, 1, 200), (2, 3, 200), (1, sms, 200), (2, sms, 200), (1, sms, 2048), (2, 3, 2048)):
        names = training_step_kernels(B, H, torch.float32, L)
        assert tf32_kernels(names) == {(str(i), not allow_tf32) for i in range(4)}, (B, H, L, names)
        assert not any("tensorcore_product_kernel" in n for n in names), (B, H, L, names)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", "0")
    assert not any("wgmma" in n for n in training_step_kernels(2, 3, torch.float32))
    monkeypatch.delenv("FAST_CAUSAL_ATTN_WGMMA")
    for B, H, L, E, M in ((1, 2, 100, 128, 128), (2, sms, 300, 128, 128), (2, 3, 2048, 128, 64),
                          (2, 3, 300, 256, 256), (1, 2, 200, 200, 136), (2, 3, 2048, 256, 64)):
        q, k, v = (x.requires_grad_() for x in make_inputs(B, H, L, E, M, dtype=torch.float32, device="cuda"))
        with cuda_kernels_launched() as names:
            torch.autograd.grad(fast_causal_attn.causal_dot_product(q, k, v).sum(), (q, k, v))
        assert tf32_kernels(names) == {(str(i), not allow_tf32) for i in range(4)}, (B, H, L, E, M, names)
        assert not any("tensorcore_product_kernel" in n or "recurrent" in n for n in names), (B, H, L, E, M, names)


def wgmma_tf32_launches(run):
    """How many times each pass's float32 wgmma kernel launched in run() (the profiler's events)."""
    counts = collections.Counter()
    for name, launches in kernel_launches(run)[1].items():
        if "wgmma_tf32_product_kernel" in name:
            counts[name[name.index("Pass)") + 5]] += launches
    return dict(counts)


def training_step_tf32_launches(q, k, v):
    """Each pass's float32 wgmma launches (wgmma_tf32_launches) in the forward and backward of
    fresh leaves of q, k, v."""
    def grads():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(fast_causal_attn.causal_dot_product(*leaves).sum(), leaves)

    return wgmma_tf32_launches(grads)


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
def test_float32_grad_v_reads_grad_k_segments(monkeypatch):
    """In time segments the dv pass starts from the dk pass's segment starts, transposed (dk's state
    dO^T q is dv's q^T dO), as dq from the forward's: one launch for dv where dk has two (its
    state-only launch, then the pass); the gradients match those of a dv pass that sums its own
    (FAST_CAUSAL_ATTN_REUSE_SEGMENTS=0, which the dq pass follows too) to float32 rounding, and the
    reference."""
    q, k, v = make_inputs(2, 3, 2048, 64, 48, dtype=torch.float32, device="cuda")
    grad_out = torch.randn_like(v)

    def grads():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(fast_causal_attn.causal_dot_product(*leaves), leaves, grad_out)

    assert wgmma_tf32_launches(grads) == {"0": 2, "1": 1, "2": 2, "3": 1}
    reused = grads()
    monkeypatch.setenv("FAST_CAUSAL_ATTN_REUSE_SEGMENTS", "0")
    assert wgmma_tf32_launches(grads) == {"0": 2, "1": 2, "2": 2, "3": 2}
    own = grads()
    for name, x, y in zip(("grad_q", "grad_k", "grad_v"), reused, own):
        assert relative_error(x, y) <= 1e-5, name
    monkeypatch.delenv("FAST_CAUSAL_ATTN_REUSE_SEGMENTS")
    check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld")


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("grad_kv", ["default", "two passes"])
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
@pytest.mark.parametrize("segments", ["1", "3", "8"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 64), (2, 3, 333, 40, 24), (2, 1, 130, 4, 64), (3, 2, 64, 64, 12),
                                   (1, 1, 65, 36, 60), (1, 2, 300, 128, 128), (2, 1, 130, 100, 72),
                                   (1, 1, 70, 40, 128), (1, 2, 300, 256, 256), (2, 1, 130, 200, 136)],
                         ids=shape_id)
def test_float32_plain(shape, layout, segments, wgmma, grad_kv, monkeypatch):
    """float32's forward, dq, dk and dv on the wgmma kernel (or on mma.sync) in 1, 3 or 8 time
    segments (dk and dv in the default's choice, or as two reverse passes: on wgmma in segments
    too), whole and partial last chunks, E != M, head dims above 64 (two row tiles, a partial
    one, column tiles) and above 128 (three or four row tiles, the last two summed apart), both
    layouts, two scales: within float32's 1e-5 of float64, as on mma.sync."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", wgmma)
    if grad_kv == "two passes":
        monkeypatch.setenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV", "0")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    q, k, v = make_inputs(*shape, dtype=torch.float32, device="cuda", layout=layout)
    check_at_two_scales(q, k, v, layout)


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("segments,launches", [("1", "0"), ("3", "0"), ("1", "1")],
                         ids=["one-segment-grid", "three-segments-grid", "one-launch-a-tile"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("tile_rows", ["64", "128"])
def test_float32_row_tiles_are_deterministic(tile_rows, head_dim, segments, launches, monkeypatch):
    """Above one row tile of the state's rows (64, or 128 by default: FAST_CAUSAL_ATTN_ROW_TILE_ROWS),
    the float32 wgmma kernel's row tiles in one grid add their outputs two by two into zeroed
    buffers in whichever order they finish (above two tiles, tiles 2 and 3 into their own, added to
    the output after): 0 + x + y rounds as 0 + y + x; run one launch a tile
    (FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES=1), tile 0 stores and the later ones add in launch order.
    Either way the forward and the gradients repeat bit for bit (and the output buffers, NaN-filled
    when allocated, are zeroed or written whole first)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", tile_rows)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES", launches)
    q, k, v = make_inputs(2, 8, 700, head_dim, head_dim, dtype=torch.float32, device="cuda")
    grad_out = torch.randn_like(v)
    first = output_and_gradients(q, k, v, grad_out)
    for _ in range(3):
        for name, x, y in zip(("out", "grad_q", "grad_k", "grad_v"), first, output_and_gradients(q, k, v, grad_out)):
            assert torch.equal(x, y), name


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(1, 2, 300, 128, 128), (2, 3, 130, 128, 64), (2, 1, 130, 200, 136),
                                   (1, 2, 300, 256, 256), (2, 1, 200, 64, 256)], ids=shape_id)
@pytest.mark.parametrize("tile_rows", ["64", "128"])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_float32_row_tiles_one_launch_each(normalize, tile_rows, shape, layout, monkeypatch):
    """float32's row tiles (64 or 128 of the state's rows) one launch each
    (FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES=1, in one segment): tile 0 stores its outputs and the later
    tiles add into them (no zeroed buffers; the outputs NaN-filled when allocated), with partial
    tiles and E != M, both layouts; under normalize too (the forward in up to two tiles: tile 0
    stores its part of den, tile 1 adds its own, O divided after; dq's and dk's extra row in tile
    0's outputs alone): within float32's 1e-5 of float64.
    (test_float32_row_tiles_launch_choice counts the launches.)"""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", tile_rows)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES", "1")
    q, k, v = make_inputs(*shape, dtype=torch.float32, device="cuda", layout=layout, normalize=normalize)
    check_against_reference(q, k, v, scale=0.8, normalize=normalize, layout=layout)


@on_the_wgmma_kernels
def test_float32_row_tiles_launch_choice(monkeypatch):
    """By default float32's row tiles (here of 64 rows: FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64) run one
    launch each where one row tile's blocks take as many rounds of the multiprocessors as all
    tiles' would in one launch (2 * sms pairs at E = M = 128: 4 rounds either way), and in one
    grid where not (a pair: one round against two) or where the pass runs in segments;
    FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES=0 keeps the grid."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", "64")

    def launches(B, H, L):
        q, k, v = make_inputs(B, H, L, 128, 128, dtype=torch.float32, device="cuda")
        return wgmma_tf32_launches(lambda: fast_causal_attn.causal_dot_product(q, k, v))

    assert launches(2, sms, 128) == {"0": 2}
    assert launches(1, 1, 256) == {"0": 1}
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "2")
    assert launches(2, sms, 256) == {"0": 2}  # the state-only launch and the pass, row tiles in its grid
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES", "0")
    assert launches(2, sms, 128) == {"0": 1}
    # forced, every pass once a tile of its state's rows: the forward's and dv's E = 200 (4 tiles),
    # dq's and dk's M = 136 (3)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES", "1")
    q, k, v = make_inputs(2, 1, 130, 200, 136, dtype=torch.float32, device="cuda")
    assert training_step_tf32_launches(q, k, v) == {"0": 4, "1": 3, "2": 3, "3": 4}


@on_the_wgmma_kernels
def test_float32_row_tiles_of_128_rows(monkeypatch):
    """By default a float32 block holds 128 of the state's rows above 64: up to 128 one launch a
    pass, no row tiles to sum (at 2 * sms pairs, where 64-row tiles run two launches), above 128
    two row tiles (E = 200 and M = 136 each two, launched one a tile where forced), and
    FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64 brings back tiles of 64 (four and three)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = make_inputs(2, sms, 128, 128, 128, dtype=torch.float32, device="cuda")
    assert wgmma_tf32_launches(lambda: fast_causal_attn.causal_dot_product(q, k, v)) == {"0": 1}
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "1")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES", "1")
    q, k, v = make_inputs(2, 1, 130, 200, 136, dtype=torch.float32, device="cuda")
    assert training_step_tf32_launches(q, k, v) == {"0": 2, "1": 2, "2": 2, "3": 2}
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", "64")
    assert training_step_tf32_launches(q, k, v) == {"0": 4, "1": 3, "2": 3, "3": 4}


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
def test_float32_long_sequence_stays_exact(wgmma, monkeypatch):
    """One pair, one segment, 8192 steps (128 chunks summed into one state): within 1e-5 of float64.
    The tensor cores' accumulators truncate; a state summed in them drifted past 1e-5 by 4097
    steps (wgmma_tf32_product.cuh)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", wgmma)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "1")
    q, k, v = make_inputs(1, 1, 8192, 64, 64, dtype=torch.float32, device="cuda")
    check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld")


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma.sync"])
def test_float32_unaligned_rows(wgmma, monkeypatch):
    """float32 rows that do not start at 16-byte boundaries (a view one element in) are copied into
    aligned ones by the ops: the same float32-accurate results."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA", wgmma)
    q, k, v = (torch.randn(2, 3, 200, 65, device="cuda")[..., 1:] / 8 for _ in range(3))
    check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld")


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("head", [0, 1, 3, 7])
@pytest.mark.parametrize("segments,shape", [(2, (1, 2, 1000, 64, 64)), (3, (2, 1, 700, 128, 40)), (4, (1, 2, 700, 128, 128))],
                         ids=lambda case: str(case) if isinstance(case, int) else shape_id(case))
def test_float32_state_heads_and_tails(shape, segments, head, monkeypatch):
    """float32's wgmma state-only launch in heads and tails (KernelParams::state_head: each segment
    summed by two blocks, the scan adding the two; the launcher's choice where whole segments
    leave multiprocessors idle, FAST_CAUSAL_ATTN_TC_STATE_HEAD forces heads of N chunks, 0 whole
    segments). Heads of 1 to 7 chunks of segments of 8 chunks (1000 steps in 2), 4 (700 in 3: the
    reverse passes' last segment 188 steps, shorter than a head of 3 or 7, its tail empty) or 3
    (700 in 4), with row and column tiles (E = 128): forward, dq (with heads of 3 from its own
    segments, not the forward's), dk and dv within float32's 1e-5 of float64."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", str(segments))
    monkeypatch.setenv("FAST_CAUSAL_ATTN_TC_STATE_HEAD", str(head))
    if head == 3:
        monkeypatch.setenv("FAST_CAUSAL_ATTN_REUSE_SEGMENTS", "0")
    q, k, v = make_inputs(*shape, dtype=torch.float32, device="cuda")
    check_against_reference(q, k, v, scale=0.9, normalize=False, layout="bhld")


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("segments,shape", [(2, (1, 2, 4100, 64, 64)), (3, (1, 2, 4100, 128, 96))],
                         ids=lambda case: str(case) if isinstance(case, int) else shape_id(case))
def test_float32_state_only_ring(shape, segments, monkeypatch):
    """float32's state-only blocks stage their chunks in a ring of their own (six slots at 64 of
    the state's rows, four at 128: wgmma_tf32::Layout), the forward's and dk's state-only launches
    over segments of 33 and 22 chunks (the ring gone round five times): output and gradients
    within 1e-5 of float64, and bit for bit those of the pass's ring
    (FAST_CAUSAL_ATTN_TC_STATE_SLOTS=2), which sums each chunk in the same order."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", str(segments))
    monkeypatch.setenv("FAST_CAUSAL_ATTN_REUSE_SEGMENTS", "0")  # dq from a state-only launch of its own too
    q, k, v = make_inputs(*shape, dtype=torch.float32, device="cuda")
    check_against_reference(q, k, v, scale=1.0, normalize=False, layout="bhld", tolerance=1e-5)
    grad_out = torch.randn_like(v)
    deep = output_and_gradients(q, k, v, grad_out)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_TC_STATE_SLOTS", "2")
    for name, x, y in zip(("out", "grad_q", "grad_k", "grad_v"), deep, output_and_gradients(q, k, v, grad_out)):
        assert torch.equal(x, y), name


@on_the_wgmma_kernels
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("shape", [(2, 2, 300, 64, 64), (1, 2, 1000, 128, 128)], ids=shape_id)
def test_float32_magnitudes_spread_within_a_tile(shape):
    """float32 with magnitudes spread 2^20 inside each 64 x 64 tile (and each 64 x 128 scale group
    of q and k where a block holds 128 of the state's rows): q's rows (timesteps), k's and v's
    columns each from 1 down to 2^-20. The output's element (t, m) is q's row scale times v's
    column scale times an unscaled output, and dq's (t, e) k's column scale times an unscaled one:
    each divided by its scales, within 1e-5 of float64, so the small rows and columns are as exact
    as the large (the float32 wgmma kernel scales each tile by one power of two: an element 2^-k
    below its tile's largest keeps 2^(k - 39) of itself, wgmma_tf32_product.cuh). dk and dv
    norm-wise."""
    B, H, L, E, M = shape
    q, k, v = make_inputs(B, H, L, E, M, dtype=torch.float64, device="cpu")
    spread = lambda n: torch.pow(2.0, -20.0 * torch.arange(n, dtype=torch.float64) / (n - 1))
    rows = spread(64).repeat(L // 64 + 1)[:L].view(L, 1)  # each chunk's timesteps, 1 ... 2^-20
    q, k, v = q * rows, k * spread(E), v * spread(M)
    q, k, v = (x.to(device="cuda", dtype=torch.float32).requires_grad_() for x in (q, k, v))
    out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=False, scale=1.0)
    grad_out = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(device="cuda", dtype=torch.float32))
    exact = reference_with_grads(q, k, v, grad_out, normalize=False, scale=1.0)
    out_scales = rows * spread(M)
    assert relative_error(out.cpu() / out_scales, exact[0] / out_scales) <= 1e-5, "out"
    assert relative_error(grads[0].cpu() / spread(E), exact[1] / spread(E)) <= 1e-5, "grad_q"
    for name, x, ref in zip(("grad_k", "grad_v"), grads[1:], exact[2:]):
        assert relative_error(x, ref) <= 1e-5, name


def states_step(q, k, v, state0, layout, scale, normalize=False):
    """(out, final kv, final k_sum) of a call from state0 (or from zeros: None) that returns its
    final state."""
    out, state = fast_causal_attn.causal_linear_attention(q, k, v, scale=scale, normalize=normalize, layout=layout,
                                                          initial_state=state0, return_final_state=True)
    return out, state.kv, state.k_sum


STATE_CALL_RESULTS = ["out", "final kv", "final k_sum", "grad q", "grad k", "grad v", "grad kv0", "grad k_sum0"]


def check_state_call(q, k, v, state0, dims, gen, attend, reference, exact_in_float32):
    """attend(q, k, v, state0) -> (out, final kv, final k_sum) on CUDA, and its gradients into q, k, v
    and state0 (a list: [kv0, k_sum0] or empty), against reference (the same in float64, or with
    dtype= in q's dtype: plain PyTorch), with cotangents exact in q's dtype drawn from gen for
    dims = (B, H, E, M). The results named in exact_in_float32 within 1e-5 (float32 sums of inputs
    read exactly), the others within twice plain PyTorch's error in the dtype (at least
    ERROR_FLOOR), both against float64."""
    B, H, E, M = dims
    dtype = q.dtype
    weights = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
               for shape in (v.shape, (B, H, E, M), (B, H, E))]

    def run(call, device):
        leaves = [x.detach().to(device).requires_grad_() for x in (q, k, v, *state0)]
        outputs = call(*leaves[:3], leaves[3:])
        loss = sum((x.double() * w.to(device)).sum() for x, w in zip(outputs, weights))
        return [x.detach().cpu() for x in (*outputs, *torch.autograd.grad(loss, leaves))]

    got = run(attend, "cuda")
    exact = run(reference, "cpu")
    plain = run(lambda *x: reference(*x, dtype=dtype), "cuda")
    for name, x, ref, p in zip(STATE_CALL_RESULTS, got, exact, plain):
        if name in exact_in_float32:
            assert x.dtype == torch.float32, name
            tolerance = 1e-5
        else:
            tolerance = error_bound(relative_error(p, ref), dtype)
        err = relative_error(x, ref)
        assert err <= tolerance, f"{name}: relative error {err:.3g} > tolerance {tolerance:.3g}"


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_states_take_the_wgmma_kernels(dtype, monkeypatch):
    """A state in and out without normalize runs on the wgmma kernels, forward and backward (16-bit:
    dk with dv in one pass, float32: two reverse passes), in one segment and in three, and on no
    mma.sync or chunked kernel."""
    B, H, L, E, M = 2, 3, 300, 64, 64
    for segments in ("1", "3"):
        monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
        q, k, v = (x.requires_grad_() for x in make_inputs(B, H, L, E, M, dtype=dtype, device="cuda"))
        state0 = [x.cuda().requires_grad_() for x in make_state(B, H, E, M, dtype, False)]
        with cuda_kernels_launched() as names:
            out, kv1, k_sum1 = states_step(q, k, v, state0, "bhld", 0.5)
            torch.autograd.grad((out.float().sum() + kv1.sum() + k_sum1.sum()), (q, k, v, *state0))
        assert any("wgmma" in n for n in names), names
        assert not any("tensorcore_product_kernel" in n or "chunked" in n or "recurrent" in n for n in names), names
        fused = any("wgmma_grad_kv_kernel" in n for n in names)
        assert fused == (dtype != torch.float32), names
        # the final key sum: 16-bit, from the forward's own staged chunks (KernelParams::key_sum_end;
        # in segments each one's sums added after the pass), float32 by a sum of its own over k
        assert any("key_sum_slabs" in n for n in names) == (dtype == torch.float32), names
        if dtype != torch.float32:
            assert any("key_sum_finish" in n for n in names) == (segments == "3"), names
        # 16-bit in segments at E = M = 64: the forward and dk with dv in one launch each, from the
        # given start too (no state-only launch, no scan)
        if dtype != torch.float32 and segments == "3":
            assert not any("scan_segments" in n for n in names), names


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(2, 3, 300, 64, 64), (1, 2, 700, 128, 96), (1, 2, 260, 256, 64),
                                   (2, 1, 200, 40, 256)], ids=shape_id)
def test_states_on_the_wgmma_kernels(shape, layout, segments, scale, dtype, monkeypatch):
    """An initial state in and the final state out, without normalize, on the wgmma kernels where
    the build has them (test_states_take_the_wgmma_kernels), the key sums beside them (the
    forward's final k_sum, dk's constant row from the final k_sum's gradient), the reverse passes'
    start and end rescaled where scale != 1 (16-bit dk with dv in one pass, its end transposed;
    above 128 two passes): in 1 or 3 time segments (at E, M <= 64 the 16-bit forward's and dk
    with dv's in one launch, the given start added after the segments before), E != M, E or M above 128,
    both layouts. The output and the gradients of q, k and v within twice plain PyTorch's error in
    the dtype (at least ERROR_FLOOR), the final state and the initial state's gradients within 1e-5
    (float32 sums of inputs read exactly), all against float64."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    B, H, L, E, M = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, layout, segments, scale, dtype)).encode()))
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", layout=layout, generator=gen)
    state0 = list(make_state(B, H, E, M, dtype, False))
    check_state_call(q, k, v, state0, (B, H, E, M), gen,
                     lambda q, k, v, s: states_step(q, k, v, s, layout, scale),
                     lambda q, k, v, s, **kw: reference_with_state(q, k, v, s, scale=scale, layout=layout, **kw),
                     exact_in_float32={"final kv", "final k_sum", "grad kv0", "grad k_sum0"})


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("segments,one_launch", [("1", "0"), ("3", "0"), ("3", "1")], ids=["one", "three-launches", "one-launch"])
@pytest.mark.parametrize("shape", [(2, 3, 300, 64, 64), (1, 2, 700, 128, 96), (1, 2, 260, 256, 64), (2, 1, 200, 40, 256),
                                   (1, 2, 333, 24, 24)], ids=shape_id)
def test_final_state_without_initial_state(shape, segments, one_launch, dtype, monkeypatch):
    """The final state without an initial one and without normalize, 16-bit (a prefill's call): the
    final k_sum the forward's kernels sum from the chunks they stage (KernelParams::key_sum_end: the
    first group of column tile 0, each group its half at E = 256; in time segments each segment's
    sums added after the pass, in three launches or one), no sum of its own over k after the pass;
    columns past E unwritten at E = 24; k_sum and kv within 1e-5 of float64, the output as the
    call without a state."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ONE_LAUNCH", one_launch)
    B, H, L, E, M = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, segments, one_launch, dtype)).encode()))
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", generator=gen)
    with cuda_kernels_launched() as names:
        out, state = fast_causal_attn.causal_linear_attention(q, k, v, return_final_state=True)
    assert not any("key_sum_slabs" in n for n in names), names
    _, kv, k_sum = reference_with_state(q, k, v)
    assert state.k_sum.dtype == torch.float32 and state.k_sum.shape == (B, H, E)
    for name, x, ref in (("final k_sum", state.k_sum, k_sum), ("final kv", state.kv, kv)):
        err = relative_error(x, ref)
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"
    plain = fast_causal_attn.causal_dot_product(q, k, v)
    assert relative_error(out, plain) <= error_bound(0.0, dtype), "the output moved with the state out"


@on_the_wgmma_kernels
@pytest.mark.parametrize("allow_tf32", [False, True], ids=["exact", "tf32-allowed"])
def test_float32_normalized_forward_takes_the_wgmma_kernel(allow_tf32, monkeypatch):
    """float32 under normalize: the forward runs on wgmma_tf32_product_kernel's normalizer instances
    (KeySum) where the state's rows fit one row tile (E up to 64 on blocks of 64 rows, up to 128 on
    blocks of 128), heads and tails or the heads alone where the user allowed TF32, in segments
    through the state-only launch and the scan, and on no mma.sync kernel; so do dq and dk (their
    extra row, in row tile 0 alone above one) and dv beside dk (as two reverse passes), the
    backward on no mma.sync or recurrent kernel, dO . O made by dq where E and M are up to 64 (else
    by backward_prepare_kernel). Above 128 the forward runs in two row tiles (den's parts summed,
    the outputs divided after the pass), and so at 128 with FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64;
    above 128 in 64-row tiles (three or four) it is not on them."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allow_tf32)
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "3")
    split = str(not allow_tf32).lower()  # (the kernels' kSplit: heads and tails unless TF32 is allowed)

    def parts(D):
        return "1" if D <= 64 else "2"

    for E, M in ((64, 64), (40, 96), (128, 128), (100, 40), (16, 200)):
        q, k, v = (x.requires_grad_() for x in make_inputs(2, 3, 300, E, M, dtype=torch.float32, device="cuda",
                                                            normalize=True))
        with cuda_kernels_launched() as names:
            out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
        launched = [tf32_arguments(n) for n in names if "wgmma_tf32_product_kernel" in n]
        assert {tuple(a) for a in launched} == {("0", split, parts(E), "true")}, (E, M, names)
        assert any("scan_segments" in n for n in names), (E, M, names)
        assert not any("tensorcore_product_kernel" in n or "chunked" in n or "recurrent" in n for n in names), names
        with cuda_kernels_launched() as names:
            torch.autograd.grad(out.sum(), (q, k, v))
        launched = {tuple(tf32_arguments(n)) for n in names if "wgmma_tf32_product_kernel" in n}
        # dq's and dk's Da is M; dv's Da is E (its Dc M)
        backward = {("1", split, parts(M), "true"), ("2", split, parts(M), "true"), ("3", split, parts(E), "true")}
        assert launched == backward, (E, M, names)
        assert not any("tensorcore_product_kernel" in n or "chunked" in n or "recurrent" in n for n in names), names
        # dO . O made by dq's producer where dq runs at one part (M up to 64) in one column tile (E
        # up to 64), else by backward_prepare_kernel before it
        assert any("backward_prepare" in n for n in names) != (E <= 64 and M <= 64), (E, M, names)
    for E, rows, on in ((256, None, "2"), (160, None, "2"), (128, "64", "1"), (256, "64", None), (160, "64", None)):
        if rows:
            monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", rows)
        q, k, v = make_inputs(2, 3, 300, E, 64, dtype=torch.float32, device="cuda", normalize=True)
        with cuda_kernels_launched() as names:
            fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
        if on:
            launched = {tuple(tf32_arguments(n)) for n in names if "wgmma_tf32_product_kernel" in n}
            assert launched == {("0", split, on, "true")}, (E, rows, names)
            assert not any("tensorcore_product_kernel" in n or "chunked" in n or "recurrent" in n for n in names), names
        else:
            assert not any("wgmma" in n for n in names), (E, rows, names)
        monkeypatch.delenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", raising=False)


def check_normalized_state_call(shape, seed_key, *, dtype=torch.float32, layout="bhld", scale=0.7, given_state=True):
    """A normalized call on CUDA from a given state (or zeros), the final state out, against float64
    (check_state_call): in float32 every result (outputs, final state, gradients) within 1e-5, in
    16 bits the final state; the inputs seeded from seed_key."""
    B, H, L, E, M = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr(seed_key).encode()))
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", layout=layout, normalize=True, generator=gen)
    state0 = list(make_state(B, H, E, M, dtype, True)) if given_state else []
    exact = set(STATE_CALL_RESULTS) if dtype == torch.float32 else {"final kv", "final k_sum"}
    check_state_call(q, k, v, state0, (B, H, E, M), gen,
                     lambda q, k, v, s: states_step(q, k, v, s or None, layout, scale, normalize=True),
                     lambda q, k, v, s, **kw: reference_with_state(q, k, v, s or None, scale=scale, normalize=True,
                                                                   layout=layout, **kw),
                     exact_in_float32=exact)


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("state", ["zero", "given"])
@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(2, 3, 300, 64, 64), (1, 2, 700, 128, 96), (2, 1, 200, 40, 256),
                                   (1, 3, 333, 128, 40), (1, 2, 100, 16, 8), (2, 1, 150, 100, 72),
                                   (1, 2, 300, 256, 64), (2, 1, 200, 160, 40)], ids=shape_id)
def test_float32_normalized_forward_on_the_wgmma_kernels(shape, layout, segments, scale, state, monkeypatch):
    """float32 under normalize with the forward on the wgmma kernel where the build has it (the key
    sum z entering each chunk handed on with S, the chunk's sums of k added from the staged float32
    k, q . z as one more product against z's float16 head and tail, den from the row sums of the
    masked scores and q . z, each output row times scale / den; the den it stores read by the
    backward; dq on the wgmma kernel where M is up to 128, a = -dO[t] . O[t] beside each score of
    row t and a z over its columns of k; dk and dv there too, their Cc's rows divided by den, dk's
    a beside each score of column t and e, the sums of a q / den, added to each row; above E = 128
    the forward in two row tiles, their outputs and den's parts summed, then divided): in 1 or 3
    time segments (the key sums' state-only sums
    and scan), 64 rows a block or 128, partial chunks, E != M, column tiles, both layouts, scale 1
    and 0.7, from zeros or a given state with the final state out: every result within 1e-5 of
    float64."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    check_normalized_state_call(shape, (shape, layout, segments, scale, state), layout=layout, scale=scale,
                                given_state=state == "given")


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("reuse", ["0", "1"])
@pytest.mark.parametrize("shape", [(2, 3, 300, 64, 64), (1, 2, 700, 96, 128), (1, 2, 333, 256, 40),
                                   (1, 2, 333, 40, 200)], ids=shape_id)
def test_float32_normalized_backward_segments(shape, reuse, monkeypatch):
    """float32's normalized backward on the wgmma kernels in 3 time segments: dq from its own
    state-only launch and scan (the extra row's sums of k: FAST_CAUSAL_ATTN_REUSE_SEGMENTS=0) or
    from the forward's starts and key sums (at E = 256 the forward in two row tiles); dk from its
    own (e's sums of a q / den, from the final key sum's gradient), dv from its own or from dk's
    starts (at E = 256 in two row tiles; at M = 200 dq and dk in two, their extra row in the first
    alone): every result within 1e-5 of float64, from a given state."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "3")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_REUSE_SEGMENTS", reuse)
    check_normalized_state_call(shape, (shape, reuse))


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("segments", ["1", "3"])
def test_float32_normalized_in_64_row_tiles(segments, monkeypatch):
    """float32 under normalize with FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64 at E = 96, M = 256: the
    forward in two row tiles of 64 (den's parts summed, the outputs divided after), dq and dk in
    four (tiles 2 and 3 adding into their own buffer; the extra row in tile 0 alone), dv in two:
    every result within 1e-5 of float64, from a given state."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS", "64")
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    check_normalized_state_call((1, 2, 300, 96, 256), ("64-row tiles", segments))


@on_the_wgmma_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 300, 64, 64), (1, 2, 700, 128, 96), (2, 1, 200, 40, 256),
                                   (1, 3, 333, 128, 40), (2, 1, 150, 40, 96), (1, 2, 300, 256, 72),
                                   (1, 1, 260, 160, 200)], ids=shape_id)
def test_normalized_forward_takes_the_wgmma_kernel(shape, dtype, monkeypatch):
    """The 16-bit normalized forward runs on wgmma_product_kernel (one or two atoms on one warpgroup
    or two; four, above 128 of the state's rows, split between two), in segments through the
    state-only launch and the scan, or at E and M up to 64 in one launch (its key sums published
    beside the state's: test_normalized_forward_in_one_launch), and on no mma.sync
    kernel; in its backward dq on wgmma_product_kernel (the extra row beside) with the same
    instances, dk with dv in one pass on wgmma_grad_kv_kernel where E and M are up to 64 and on
    wgmma_grad_kv_wide_kernel up to 128 (q / den staged, the extra row beside), above 128 as two
    reverse passes of wgmma_product_kernel (dk's extra row beside, q / den staged), and no mma.sync
    kernel anywhere; dO . O made by dq's producer where dq runs at up to two atoms in one
    column tile, else by backward_prepare_kernel. Where E and M are up to 64 the bfloat16
    backward is the one pass (dq beside dk and dv on wgmma_grad_kv_kernel: no dq pass, dO . O by
    backward_prepare_kernel in these three segments; float16 the two passes: one_pass_backward).
    FAST_CAUSAL_ATTN_WGMMA_GROUPS=1 leaves four atoms to mma.sync (no one-warpgroup instance has
    the normalizer)."""
    B, H, L, E, M = shape
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", "3")
    q, k, v = (x.requires_grad_() for x in make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", normalize=True))

    def atoms(D):
        return 1 if D <= 64 else 2 if D <= 128 else 4

    with cuda_kernels_launched() as names:
        out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
    assert wgmma_instances(names) == {("0", atoms(E), 2 if atoms(E) == 4 or M > 64 else 1)}, names
    # in three launches (the state-only blocks, the scans, the pass), or at E and M up to 64 in one
    assert any("scan_segments" in n for n in names) != (E <= 64 and M <= 64), names
    assert not any("tensorcore_product_kernel" in n or "chunked" in n or "recurrent" in n for n in names), names
    with cuda_kernels_launched() as names:
        torch.autograd.grad(out.float().sum(), (q, k, v))
    narrow, fused = E <= 64 and M <= 64, E <= 128 and M <= 128
    assert any("wgmma_grad_kv_kernel" in n for n in names) == narrow, names
    assert any("wgmma_grad_kv_wide_kernel" in n for n in names) == (fused and not narrow), names
    one_pass = narrow and dtype == torch.bfloat16
    assert (one_pass_launches(names) >= 1) == one_pass, names  # (the one pass: no dq pass)
    dq = set() if one_pass else {("1", atoms(M), 2 if atoms(M) == 4 or E > 64 else 1)}
    assert {i for i in wgmma_instances(names) if i[0] == "1"} == dq, names
    # dO . O made by dq's producer where dq runs at up to two atoms in one column tile (64 of E a
    # group), else by backward_prepare_kernel before it (the one pass's producer makes them in one
    # segment alone: test_one_pass_backward_where_the_forward_kept_its_ends)
    dq_makes_dots = not one_pass and atoms(M) <= 2 and E <= 128
    assert any("backward_prepare" in n for n in names) != dq_makes_dots, names
    # dk's Da is M, dv's E: one warpgroup, or four atoms on two
    two_passes = set() if fused else {("2", atoms(M), 2 if atoms(M) == 4 else 1),
                                      ("3", atoms(E), 2 if atoms(E) == 4 else 1)}
    assert {i for i in wgmma_instances(names) if i[0] in "23"} == two_passes, names
    assert not any("tensorcore_product_kernel" in n or "chunked" in n or "recurrent" in n for n in names), names
    if E > 128 or M > 128:  # no normalized instance of one warpgroup at four atoms: mma.sync there
        monkeypatch.setenv("FAST_CAUSAL_ATTN_WGMMA_GROUPS", "1")
        with cuda_kernels_launched() as names:
            out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
        assert any("tensorcore_product_kernel" in n for n in names) == (E > 128), names
        assert {i[1] for i in wgmma_instances(names)} <= {1, 2}, names


@CUDA
@pytest.mark.usefixtures("nan_filled_outputs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state", ["zero", "given"])
@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("segments", ["1", "3"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(2, 3, 300, 64, 64), (1, 2, 700, 128, 96), (2, 1, 200, 40, 256),
                                   (1, 3, 333, 128, 40), (1, 2, 100, 16, 8), (2, 1, 150, 40, 96),
                                   (1, 2, 300, 256, 72), (1, 1, 260, 160, 200)], ids=shape_id)
def test_normalized_forward_on_the_wgmma_kernels(shape, layout, segments, scale, state, dtype, monkeypatch):
    """normalize=True with the forward on the wgmma kernels where the build has them (the key sum
    entering each chunk, den from the row sums of the masked scores as rounded for P Cc and q . z,
    each output row times scale / den; test_normalized_forward_takes_the_wgmma_kernel), its den
    and kept segment starts read by the backward (dq on wgmma, dk with dv in one wgmma pass at
    E, M <= 128 and as two above, the extra row beside, q / den staged): in 1 or 3 time
    segments (the key sums' state-only sums and scan), one atom or two, one warpgroup or two, four
    atoms with the state's rows split between two (their row sums added; a partial last atom),
    partial chunks, E != M, both layouts, scale 1 and 0.7, from zeros or a given state with
    the final state out (check_state_call:
    the final state within 1e-5; the initial state's gradients held to the outputs' tolerance, the
    normalized backward making them from the 16-bit output read back, dO . O, and from q / den
    rounded to 16 bits)."""
    monkeypatch.setenv("FAST_CAUSAL_ATTN_SEGMENTS", segments)
    check_normalized_state_call(shape, (shape, layout, segments, scale, state, dtype), dtype=dtype, layout=layout,
                                scale=scale, given_state=state == "given")
