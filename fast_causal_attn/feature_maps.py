"""Feature maps for the queries and keys of linear attention.

A feature map phi turns softmax attention's exp(q . k) into phi(q) . phi(k). Normalized linear
attention divides by phi(q) . sum phi(k), so it needs a non-negative map: "elu" (elu + 1, from
Katharopoulos et al. 2020, fast-transformers' default) or "relu". "identity" suits the
unnormalized form. Any callable that maps a tensor to one of the same shape works too.
"""
import torch.nn.functional as F

__all__ = ["elu_plus_one", "relu", "identity", "FEATURE_MAPS", "get"]


def elu_plus_one(x):
    """elu(x) + 1: positive, smooth, and linear for x > 0."""
    return F.elu(x) + 1


def relu(x):
    """max(x, 0)."""
    return F.relu(x)


def identity(x):
    """x unchanged."""
    return x


FEATURE_MAPS = {"elu": elu_plus_one, "relu": relu, "identity": identity}


def get(feature_map):
    """The feature map named by `feature_map` ("elu", "relu", "identity"), or `feature_map` itself
    when it is callable."""
    if callable(feature_map):
        return feature_map
    if isinstance(feature_map, str) and feature_map in FEATURE_MAPS:
        return FEATURE_MAPS[feature_map]
    raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, got {feature_map!r}")
