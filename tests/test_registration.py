"""The ops as torch sees them: schemas, fake implementations, torch.compile."""
import pytest
import torch

import fast_causal_attn
from conftest import DEVICES, cases
from reference import make_inputs, make_state

ops = torch.ops.fast_causal_attn


def op_inputs(device, layout, normalize, dtype=torch.float32, L=70):
    return make_inputs(2, 3, L, 8, 6, dtype=dtype, device=device, layout=layout, normalize=normalize)


# Long enough that the CUDA kernels split time into segments (6 sequence-heads, 4 chunks of 64
# timesteps a segment at least), whose starts the forward returns for the dq pass: their count is
# a size the fake kernel cannot know.
SEGMENTED_L = 1100


# Every (layout, normalize, with_state, device) the opcheck tests run.
op_cases = cases(
    pytest.mark.parametrize("device", DEVICES),
    pytest.mark.parametrize("with_state", [False, True], ids=["stateless", "state"]),
    pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"]),
    pytest.mark.parametrize("layout", ["bhld", "blhd"]),
)


def op_case(layout, normalize, with_state, device, L=70):
    """q, k, v and an initial state (or Nones) for one case."""
    q, k, v = op_inputs(device, layout, normalize, L=L)
    if not with_state:
        return q, k, v, None, None
    B, H = q.shape[0], (q.shape[2] if layout == "blhd" else q.shape[1])
    return (q, k, v, *(x.to(device) for x in make_state(B, H, q.shape[-1], v.shape[-1], q.dtype, normalize)))


# forward and backward carry no autograd kernel of their own: their gradient is the autograd
# kernel of the op attention (csrc/autograd.cpp), which the public API goes through (tested by
# gradcheck). opcheck runs them on inputs that do not require grad, and attention on inputs that do.
segment_lengths = pytest.mark.parametrize("L", [70, SEGMENTED_L], ids=["short", "segmented"])


@op_cases
@segment_lengths
@pytest.mark.parametrize("keep_segments", [False, True], ids=["drop_segments", "keep_segments"])
def test_opcheck_forward(layout, normalize, with_state, device, L, keep_segments):
    q, k, v, kv0, k_sum0 = op_case(layout, normalize, with_state, device, L)
    torch.library.opcheck(ops.forward.default,
                          (q, k, v, kv0, k_sum0, None, 0.5, normalize, 1e-6, layout, with_state, keep_segments))


@op_cases
@segment_lengths
@pytest.mark.parametrize("with_segments", [False, True], ids=["own_segments", "forward_segments"])
def test_opcheck_backward(layout, normalize, with_state, device, L, with_segments):
    q, k, v, kv0, k_sum0 = op_case(layout, normalize, with_state, device, L)
    out, den, kv1, k_sum1, segment_kv, segment_k_sum = ops.forward(q, k, v, kv0, k_sum0, None, 0.5, normalize, 1e-6,
                                                                   layout, with_state, with_segments)
    if device == "cuda" and L == SEGMENTED_L and with_segments:  # the case that has them
        assert segment_kv.shape[1] > 1  # and key sums under normalize (the backward that reads them):
        assert segment_k_sum.shape[1] == (segment_kv.shape[1] if normalize else 0)
    grad_out = torch.randn_like(out)
    grad_final = (torch.randn_like(kv1), torch.randn_like(k_sum1)) if with_state else (None, None)
    saved = (out, den) if normalize else (None, None)
    segments = (segment_kv, segment_k_sum) if with_segments else (None, None)
    torch.library.opcheck(ops.backward.default, (grad_out, *grad_final, q, k, v, *saved, kv0, k_sum0, None, 0.5,
                                                 normalize, layout, *segments))


@op_cases
@segment_lengths
def test_opcheck_attention(layout, normalize, with_state, device, L):
    q, k, v, kv0, k_sum0 = op_case(layout, normalize, with_state, device, L)
    leaves = [None if x is None else x.requires_grad_() for x in (q, k, v, kv0, k_sum0)]
    torch.library.opcheck(ops.attention.default, (*leaves, None, 0.5, normalize, 1e-6, layout, with_state, True))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_in_inference_mode(device):
    """Inference tensors skip autograd's dispatch: attention is then the forward alone."""
    q, k, v = op_inputs(device, "bhld", False)
    expected = ops.forward(q, k, v, None, None, None, 0.5, False, 1e-6, "bhld", False, False)[0]
    with torch.inference_mode():
        out = ops.attention(q, k, v, None, None, None, 0.5, False, 1e-6, "bhld", False, False)[0]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@segment_lengths
def test_torch_compile_fullgraph(layout, normalize, device, L):
    torch._dynamo.reset()

    def attention_block(q, k, v):
        out = fast_causal_attn.causal_linear_attention(q, k, v, scale=0.5, normalize=normalize, layout=layout)
        return torch.nn.functional.gelu(out) * 2

    compiled = torch.compile(attention_block, fullgraph=True, backend="aot_eager")
    q, k, v = (x.requires_grad_() for x in op_inputs(device, layout, normalize, L=L))
    eager_out = attention_block(q, k, v)
    eager_grads = torch.autograd.grad(eager_out.sum(), (q, k, v))
    compiled_out = compiled(q, k, v)
    compiled_grads = torch.autograd.grad(compiled_out.sum(), (q, k, v))
    torch.testing.assert_close(compiled_out, eager_out)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e)


def _training_loss(q, k, v):
    return fast_causal_attn.causal_dot_product(q.relu(), k.relu(), v).square().mean()


def assert_matches_eager(loss, grads, q, k, v):
    """A compiled step's loss and gradients of q, k and v are eager's."""
    eager_loss = _training_loss(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss)
    for c, e in zip(grads, eager_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("device", DEVICES)
@segment_lengths
def test_torch_compile_inductor(device, L):
    """The default backend as a training script would use it: no graph break, same numbers."""
    torch._dynamo.reset()
    q, k, v = (x.requires_grad_() for x in op_inputs(device, "bhld", False, L=L))
    compiled = torch.compile(_training_loss, fullgraph=True)
    loss = compiled(q, k, v)
    assert_matches_eager(loss, torch.autograd.grad(loss, (q, k, v)), q, k, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_compiled_autograd(normalize, device):
    """An eager forward and its backward run under compiled autograd (the backward called inside
    torch.compile with torch._dynamo.config.compiled_autograd): the graph compiled autograd
    captures holds the op's own autograd node, whose gradients are eager's. (A node written out by
    hand rather than built by torch::autograd::Function had no compiled_args and raised here:
    benchmarks/experiments/autograd_node.patch.)"""
    from torch._dynamo.utils import counters

    def loss_of(q, k, v):
        return fast_causal_attn.causal_linear_attention(q.relu(), k.relu(), v, normalize=normalize).square().mean()

    q, k, v = (x.requires_grad_() for x in op_inputs(device, "bhld", normalize))
    eager_grads = torch.autograd.grad(loss_of(q, k, v), (q, k, v))
    torch._dynamo.reset()
    counters.clear()
    loss = loss_of(q, k, v)

    def backward():
        loss.backward()

    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(backward, backend="aot_eager")()
    assert counters["compiled_autograd"]["captures"] == 1, dict(counters["compiled_autograd"])
    for x, e in zip((q, k, v), eager_grads):
        torch.testing.assert_close(x.grad, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@segment_lengths
def test_torch_compile_keeps_cuda_graphs(L):
    """mode="reduce-overhead" captures a training step through the ops in CUDA graphs: nothing in
    the graph has a size only the real call knows (with static shapes the forward's segment
    starts, which the dq pass starts from, have a count planned ahead: _planned_segments)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    q, k, v = (x.requires_grad_() for x in op_inputs("cuda", "bhld", False, L=L))
    compiled = torch.compile(_training_loss, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, recording, replay
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert_matches_eager(loss, grads, q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize(
    "dtype,shape,normalize,with_state,env,misaligned",
    [
        (torch.bfloat16, (8, 16, 2048, 64, 64), False, False, {}, False),
        (torch.bfloat16, (1, 16, 8192, 128, 128), True, False, {}, False),
        (torch.bfloat16, (2, 3, 1100, 8, 6), False, True, {}, False),
        (torch.bfloat16, (2, 4, 8192, 64, 64), False, False, {}, True),
        (torch.float32, (2, 4, 8192, 64, 64), True, False, {}, False),
        (torch.float32, (1, 4, 4096, 128, 128), False, False, {}, False),
        (torch.float32, (8, 16, 1024, 128, 128), False, False, {}, False),
        (torch.float16, (2, 4, 1, 64, 64), False, False, {}, False),
        (torch.bfloat16, (0, 4, 8192, 64, 64), False, False, {}, False),
        (torch.bfloat16, (2, 4, 0, 64, 64), False, False, {}, False),
        (torch.bfloat16, (2, 4, 0, 64, 64), False, True, {}, False),
        (torch.bfloat16, (2, 4, 8192, 64, 64), False, False, {"FAST_CAUSAL_ATTN_KERNEL": "chunked"}, False),
        (torch.bfloat16, (2, 4, 8192, 64, 64), False, False, {"FAST_CAUSAL_ATTN_SEGMENTS": "5"}, False),
    ],
    ids=["bf16", "bf16-E128-normalized", "bf16-small-state", "bf16-misaligned", "fp32-normalized", "fp32-E128",
         "fp32-E128-recurrent", "fp16-decode", "empty-batch", "empty-sequence", "empty-sequence-state", "chunked",
         "forced-5"],
)
def test_planned_segments_are_the_forwards(dtype, shape, normalize, with_state, env, misaligned, monkeypatch):
    """The segment count the fake kernel plans for static shapes (torch.compile; _C.
    plan_forward_segments) is the one the forward keeps, whichever family runs (0 where the
    tensor-core family does not, or for a decoding step), with the switches, and for rows off
    16-byte boundaries (which stage chunks another way but split time the same)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    B, H, L, E, M = shape
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device="cuda", normalize=normalize)
    if misaligned:  # the same values one element into a larger buffer: rows off 16-byte boundaries
        q = torch.cat([q.new_zeros(1), q.flatten()])[1:].view(q.shape)
    state = tuple(x.to("cuda") for x in make_state(B, H, E, M, dtype, normalize)) if with_state else (None, None)
    args = (None, 1.0, normalize, 1e-6, "bhld", with_state, True)
    segment_kv, segment_k_sum = ops.forward(q, k, v, *state, *args)[4:]
    with FakeTensorMode() as mode:
        fakes = [None if x is None else mode.from_tensor(x) for x in (q, k, v, *state)]
        planned_kv, planned_k_sum = ops.forward(*fakes, *args)[4:]
    assert isinstance(planned_kv.shape[1], int), "a static count"
    assert planned_kv.shape == segment_kv.shape and planned_k_sum.shape == segment_k_sum.shape


def test_plan_forward_segments_checks_its_arguments():
    """The planning function the fake kernel calls names what it takes; without a GPU (a build
    without CUDA) it plans no segments."""
    from fast_causal_attn import _C

    with pytest.raises(RuntimeError, match="float16, bfloat16, float32 or float64, got int8"):
        _C.plan_forward_segments("int8", 1, 1, 64, 8, 8, False, False, 0)
    with pytest.raises(TypeError):
        _C.plan_forward_segments("float32", 1, 1, 64, 8)
    if not torch.cuda.is_available():
        assert _C.plan_forward_segments("bfloat16", 8, 16, 2048, 64, 64, False, False, 0) == 0
