import collections
import contextlib
import os
import zlib

import pytest
import torch

# Under pytest-xdist (-n N) every worker's CPU ops (the float64 references, the CPU kernels) would
# each take all the machine's cores: N x cores threads contending for them. Each worker takes its
# share of the cores instead (results do not depend on the thread count beyond rounding order,
# well inside every tolerance).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SM90 = pytest.mark.skipif(not ON_SM90, reason="needs a device of compute capability 9.0 (the wgmma kernel's)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
# (device, CUDA kernel family): the default dispatch on each device (tensor cores where they were
# measured faster, see csrc/cuda/dispatch.cuh), and each CUDA family forced
# (FAST_CAUSAL_ATTN_KERNEL), so that every family meets the whole grid (a family takes only the
# shapes and dtypes it can run; the rest go the default way). Hopper's wgmma kernels are the
# default's wherever they can run (wgmma_launch.cuh's wgmma_takes), so "cuda" meets them on
# sm_90a builds, and "cuda-tensorcore" meets the mma.sync kernels that they replace there.
DEVICE_KERNELS = [
    pytest.param("cpu", None, id="cpu"),
    pytest.param("cuda", None, id="cuda", marks=CUDA),
    pytest.param("cuda", "recurrent", id="cuda-recurrent", marks=CUDA),
    pytest.param("cuda", "chunked", id="cuda-chunked", marks=CUDA),
    pytest.param("cuda", "tensorcore", id="cuda-tensorcore", marks=CUDA),
]

# The same for calls with states or cu_seqlens, which the CUDA chunked families take (tensor cores
# where eligible, else the chunked family).
STATE_KERNELS = [
    pytest.param("cpu", None, id="cpu"),
    pytest.param("cuda", None, id="cuda", marks=CUDA),
    pytest.param("cuda", "chunked", id="cuda-chunked", marks=CUDA),
    pytest.param("cuda", "tensorcore", id="cuda-tensorcore", marks=CUDA),
]


@pytest.fixture
def use_kernel(monkeypatch):
    """use_kernel(family) forces a CUDA kernel family for the rest of the test (None: default)."""

    def use(family):
        if family is not None:
            monkeypatch.setenv("FAST_CAUSAL_ATTN_KERNEL", family)

    return use


def cases(*marks):
    """One decorator for a stack of parametrize marks, outermost first, shared by several tests."""

    def apply(test):
        for mark in reversed(marks):
            test = mark(test)
        return test

    return apply


@pytest.fixture
def nan_filled_outputs():
    """Every torch.empty, ours included, comes back filled with NaN: an output element the kernel
    never writes then fails the comparison instead of passing on leftover memory."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous[0])
    torch.utils.deterministic.fill_uninitialized_memory = previous[1]


@pytest.fixture(autouse=True)
def seeded_rng(request):
    """Fresh random data in every test, the same on every run: a failure reproduces."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@contextlib.contextmanager
def cuda_kernels_launched():
    """The CUDA kernels launched inside the block (from the profiler): the Counter it gives, name ->
    launches (iterating it gives the names), filled when the block ends."""
    launches = collections.Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        yield launches
        torch.cuda.synchronize()
    launches.update(e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)
