import shutil

import pytest

from streamchat.placement import native
from streamchat.placement.native import NativeKernels, load_native_kernels

# Where the kernels must build: this CPU runs them and a C compiler is here.
BUILDS_HERE = native._cpu_runs_them() and shutil.which("cc") is not None


@pytest.fixture(scope="session")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> NativeKernels:
    """streamchat's native kernels, built afresh for these tests; the test skips where they cannot run."""
    built = load_native_kernels(tmp_path_factory.mktemp("kernels"))
    if built is None:
        assert not BUILDS_HERE, "the native kernels did not build on a CPU that runs them, with a C compiler here"
        pytest.skip("this machine cannot build or run the native kernels (AVX-512 VNNI on Linux x86-64, a C compiler)")
    return built
