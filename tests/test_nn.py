"""The layer: against a plain-PyTorch reference layer, step-by-step decoding, feature maps,
torch.compile, autocast and DDP, on the CPU and on CUDA."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from fast_causal_attn import feature_maps
from fast_causal_attn.nn import CausalLinearAttention
from conftest import DEVICES
from reference import reference, relative_error


def reference_layer(layer, x):
    """The same layer in plain PyTorch and float64, with the quadratic reference for attention."""
    B, L, _ = x.shape
    heads = (B, L, layer.num_heads, layer.head_dim)
    x = x.double()
    proj = lambda lin: F.linear(x, lin.weight.double(), None if lin.bias is None else lin.bias.double())
    q = layer.feature_map(proj(layer.q_proj).view(heads))
    k = layer.feature_map(proj(layer.k_proj).view(heads))
    v = proj(layer.v_proj).view(heads)
    out = reference(q, k, v, normalize=layer.normalize, eps=layer.eps, layout="blhd")
    out = out.reshape(B, L, -1)
    return F.linear(out, layer.out_proj.weight.double(),
                    None if layer.out_proj.bias is None else layer.out_proj.bias.double())


# ids by name: an object's default id holds its address, which differs between pytest-xdist's workers
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity", torch.sigmoid],
                         ids=lambda f: f if isinstance(f, str) else f.__name__)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_layer_matches_reference(feature_map, bias, device):
    normalize = feature_map != "identity"
    layer = CausalLinearAttention(48, 4, feature_map=feature_map, normalize=normalize, bias=bias, head_dim=16,
                                  device=device)
    x = torch.randn(2, 70, 48, device=device, requires_grad=True)
    y = layer(x)
    y_ref = reference_layer(layer, x)
    assert y.shape == (2, 70, 48) and relative_error(y, y_ref) <= 1e-5
    w = torch.randn_like(y_ref)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad((y.double() * w).sum(), params)
    grads_ref = torch.autograd.grad((y_ref * w).sum(), params)
    for g, r in zip(grads, grads_ref):
        assert relative_error(g, r) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_step_by_step_decoding_matches_full_sequence(device):
    layer = CausalLinearAttention(32, 2, device=device)
    x = torch.randn(3, 25, 32, device=device)
    full = layer(x)
    state, steps = None, []
    for t in range(x.shape[1]):
        y, state = layer(x[:, t : t + 1], state=state, return_state=True)
        steps.append(y)
    assert relative_error(torch.cat(steps, dim=1), full) <= 1e-5
    assert state.kv.shape == (3, 2, 16, 16) and state.k_sum.shape == (3, 2, 16)


def test_feature_maps():
    x = torch.randn(100)
    torch.testing.assert_close(feature_maps.get("elu")(x), F.elu(x) + 1)
    torch.testing.assert_close(feature_maps.get("relu")(x), x.clamp(min=0))
    assert feature_maps.get("identity")(x) is x
    assert feature_maps.get(torch.tanh) is torch.tanh
    with pytest.raises(ValueError, match=r"feature_map must be one of \['elu', 'identity', 'relu'\] or a callable"):
        feature_maps.get("softmax")


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match=r"embed_dim \(30\) must be divisible by num_heads \(4\)"):
        CausalLinearAttention(30, 4)
    layer = CausalLinearAttention(32, 4)
    with pytest.raises(ValueError, match=r"x must be \[B, L, 32\], got \[2, 5, 16\]"):
        layer(torch.randn(2, 5, 16))


@pytest.mark.parametrize("device", DEVICES)
def test_layer_under_torch_compile(device):
    torch._dynamo.reset()
    layer = CausalLinearAttention(32, 4, device=device)
    x = torch.randn(2, 40, 32, device=device, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y, y_ref = compiled(x), layer(x)
    torch.testing.assert_close(y, y_ref)
    g = torch.autograd.grad(y.square().sum(), x)[0]
    g_ref = torch.autograd.grad(y_ref.square().sum(), x)[0]
    torch.testing.assert_close(g, g_ref)


AUTOCAST = [("cpu", torch.bfloat16), pytest.param("cuda", torch.float16, marks=DEVICES[1].marks),
            pytest.param("cuda", torch.bfloat16, marks=DEVICES[1].marks)]


@pytest.mark.parametrize("device,dtype", AUTOCAST, ids=str)
def test_layer_under_autocast(device, dtype):
    layer = CausalLinearAttention(32, 4, device=device)
    x = torch.randn(2, 40, 32, device=device)
    with torch.autocast(device, dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype
    assert relative_error(y, reference_layer(layer, x)) <= 3e-2  # 16-bit projections and attention


@pytest.mark.parametrize("device", DEVICES)
def test_layer_under_ddp(device):
    """One process of DistributedDataParallel (gloo, a file store): the layer trains like any module."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            layer = CausalLinearAttention(32, 4, device=device)
            plain = CausalLinearAttention(32, 4, device=device)
            plain.load_state_dict(layer.state_dict())
            ddp = torch.nn.parallel.DistributedDataParallel(layer)
            x = torch.randn(2, 30, 32, device=device)
            ddp(x).square().mean().backward()
            plain(x).square().mean().backward()
            for a, b in zip(layer.parameters(), plain.parameters()):
                torch.testing.assert_close(a.grad, b.grad)
        finally:
            dist.destroy_process_group()
