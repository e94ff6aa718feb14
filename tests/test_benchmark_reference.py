"""The benchmark's float64 references (benchmarks/baselines.py's chunked forms, which its
--accuracy column measures against) against the tests' quadratic reference."""
import pathlib
import sys

import pytest
import torch

from reference import make_inputs, reference, relative_error

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import baselines  # noqa: E402


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("shape", [(1, 2, 300, 16, 8), (2, 1, 64, 8, 24), (1, 1, 5, 4, 4)],
                         ids=lambda s: ",".join(map(str, s)))
def test_chunked_references_match_the_quadratic_form(shape, normalize):
    q, k, v = make_inputs(*shape, dtype=torch.float64, device="cpu", normalize=normalize)
    chunked = baselines.torch_chunked_normalized(q, k, v) if normalize else baselines.torch_chunked(q, k, v)
    expected = reference(q, k, v, normalize=normalize)
    assert relative_error(chunked, expected) <= 1e-12
