import shutil

import pytest

from streamchat.placement import device
from streamchat.placement.device import VARIANTS
from streamchat.placement.native import NativeKernels, load_native_kernels

# Where the kernels must build: this CPU runs a variant of them (the environment allowing) and a C compiler is here.
BUILDS_HERE = device.native_kernels_run_here()


@pytest.fixture(scope="session", params=[variant.name for variant in VARIANTS])
def kernels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> NativeKernels:
    """streamchat's native kernels, built afresh for these tests: each variant this CPU runs (AVX2 code runs on
    an AVX-512 CPU too); the test skips for a variant the CPU does not run."""
    variant = next(variant for variant in VARIANTS if variant.name == request.param)
    runs_here = variant.cpu_flags <= device.cpu_flags() and shutil.which("cc") is not None
    built = load_native_kernels(tmp_path_factory.mktemp("kernels"), variant.name)
    if built is None:
        assert not runs_here, f"the {variant.name} kernels did not build on a CPU that runs them, with a C compiler"
        pytest.skip(f"this machine cannot run the {variant.name} kernels (its CPU, or no C compiler)")
    assert built.variant == variant.name
    return built
