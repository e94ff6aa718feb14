"""The drop-in layer: causal linear attention with its projections."""
from torch import nn

from . import feature_maps

__all__ = ["CausalLinearAttention"]


class CausalLinearAttention(nn.Module):
    """Multi-head causal linear attention: x [B, L, embed_dim] -> [B, L, embed_dim].

    q, k and v are linear projections of x into num_heads heads of head_dim; q and k go through the
    feature map; then, per head, ``out[t] = phi(q[t]) . sum_{s<=t} phi(k[s]) v[s]^T``, divided by
    ``phi(q[t]) . sum_{s<=t} phi(k[s]) + eps`` when normalize; then the output projection. The
    cost is linear in L.

    Args:
        embed_dim: width of the input and the output.
        num_heads: number of heads.
        feature_map: "elu" (elu + 1), "relu", "identity" or a callable; see fast_causal_attn.feature_maps.
        normalize: divide by the normalizer (needs a non-negative feature map).
        eps: added to the normalizer.
        bias: whether the four projections have biases.
        head_dim: width of a head; embed_dim // num_heads by default.
        device, dtype: of the parameters.

    ``forward(x, state=None, return_state=False)``: with ``return_state=True`` it also returns the
    attention state after x, a ``State(kv, k_sum)`` of [B, num_heads, head_dim, head_dim] and
    [B, num_heads, head_dim]; passing it as ``state`` to the next call continues the sequence, so
    generation runs one token at a time (x of length 1) at constant cost per token. (On CUDA, state
    in and out needs head_dim <= 256.)

    Replacing fast-transformers' layer::

        # before: AttentionLayer(CausalLinearAttention(query_dimensions=64), d_model=512, n_heads=8)
        layer = fast_causal_attn.nn.CausalLinearAttention(512, 8, feature_map="elu", normalize=True)
        y = layer(x)                      # x: [B, L, 512]; the causal mask is built in

    Replacing fla's ``LinearAttention``::

        # before: fla.layers.LinearAttention(hidden_size=512, num_heads=8, feature_map="relu")
        layer = fast_causal_attn.nn.CausalLinearAttention(512, 8, feature_map="relu", normalize=True)
        y = layer(x)                      # x: [B, L, 512]

    fla's layer also normalizes its output (output_norm, an RMSNorm by default) and has feature maps
    of its own (hedgehog, t2r, dpfp, ...): put a norm after this layer, or pass the feature map as
    a callable, where a model relies on them. Here q_proj, k_proj, v_proj and out_proj are plain
    nn.Linear layers.
    """

    def __init__(self, embed_dim, num_heads, *, feature_map="elu", normalize=True, eps=1e-6, bias=True,
                 head_dim=None, device=None, dtype=None):
        super().__init__()
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ValueError(
                    f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), or give head_dim")
            head_dim = embed_dim // num_heads
        if num_heads < 1 or head_dim < 1 or embed_dim < 1:
            raise ValueError(f"embed_dim, num_heads and head_dim must be positive, got {embed_dim}, {num_heads}, "
                             f"{head_dim}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.feature_map = feature_maps.get(feature_map)
        self.normalize, self.eps = normalize, eps
        factory = dict(device=device, dtype=dtype)
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, inner, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, inner, bias=bias, **factory)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias, **factory)

    def forward(self, x, state=None, return_state=False):
        from . import causal_linear_attention  # the package's public function; imported late to avoid a cycle

        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [B, L, {self.embed_dim}], got {list(x.shape)}")
        B, L, _ = x.shape
        heads = (B, L, self.num_heads, self.head_dim)
        q = self.feature_map(self.q_proj(x).view(heads))
        k = self.feature_map(self.k_proj(x).view(heads))
        v = self.v_proj(x).view(heads)
        result = causal_linear_attention(q, k, v, normalize=self.normalize, eps=self.eps, layout="blhd",
                                         initial_state=state, return_final_state=return_state)
        out, new_state = result if return_state else (result, None)
        y = self.out_proj(out.reshape(B, L, self.num_heads * self.head_dim))
        return (y, new_state) if return_state else y

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"feature_map={getattr(self.feature_map, '__name__', self.feature_map)}, normalize={self.normalize}")
