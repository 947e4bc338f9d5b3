import importlib.metadata
import os
import sys
import time
from pathlib import Path

import pytest

from streamchat.errors import ConfigError, ModelAccessError, UnsupportedModelError
from streamchat.loading import conversion
from streamchat.loading.conversion import cache_root, conversion_dir, convert_gguf
from tests.support.gguf_files import write_tiny_gguf

# The small files only: the weights are read from the GGUF itself (weights/gguf_source.py).
CONVERTED_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="XDG_CACHE_HOME is the Linux convention")
def test_the_cache_lives_where_the_environment_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("STREAMCHAT_CACHE_DIR", str(tmp_path / "here"))
    assert cache_root() == tmp_path / "here"
    monkeypatch.delenv("STREAMCHAT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "streamchat"


def test_the_entry_is_named_after_the_source_fingerprint(gguf: Path):
    stat = gguf.stat()
    entry = conversion_dir(gguf)
    transformers_version = importlib.metadata.version("transformers")
    assert entry.name == f"{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers_version}-meta"
    assert entry.parent.name.startswith("tiny-")
    assert entry.parent.parent == cache_root() / "converted"


def test_first_use_converts_and_later_uses_reuse_the_copy(gguf: Path, monkeypatch: pytest.MonkeyPatch):
    notes: list[str] = []
    entry = convert_gguf(gguf, "tiny", notes.append)
    assert entry == conversion_dir(gguf)
    assert {path.name for path in entry.iterdir()} == CONVERTED_FILES
    assert len(notes) == 1
    assert notes == [f"Reading tiny.gguf's tokenizer and config once, into {entry.parent}."]

    def fail(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(conversion, "_write_conversion", fail)
    assert convert_gguf(gguf, "tiny", notes.append) == entry
    assert len(notes) == 1


def test_a_changed_source_is_converted_again_and_the_stale_copy_removed(gguf: Path):
    old_entry = convert_gguf(gguf, "tiny", print)
    time.sleep(0.01)  # a new modification time, as any rewrite of a real file has
    write_tiny_gguf(gguf, seed=1)
    new_entry = convert_gguf(gguf, "tiny", print)

    assert new_entry != old_entry
    assert list(new_entry.parent.iterdir()) == [new_entry]


def test_an_older_entry_with_float_weights_is_never_read_and_is_swept(gguf: Path):
    stat = gguf.stat()
    transformers_version = importlib.metadata.version("transformers")
    # What streamchat 0.1.0 wrote: a whole float32 copy of the weights, under the entry name without a format.
    old_entry = conversion_dir(gguf).parent / f"{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers_version}"
    old_entry.mkdir(parents=True)
    (old_entry / "model.safetensors").write_bytes(b"float32 weights")

    entry = convert_gguf(gguf, "tiny", print)
    assert entry != old_entry
    assert list(entry.parent.iterdir()) == [entry]


def test_an_interrupted_conversion_leaves_no_entry(gguf: Path, monkeypatch: pytest.MonkeyPatch):
    write_conversion = conversion._write_conversion

    def interrupted_after_writing(source: Path, name: str, destination: Path) -> None:
        write_conversion(source, name, destination)
        raise KeyboardInterrupt  # the worst moment: every file written, nothing published

    monkeypatch.setattr(conversion, "_write_conversion", interrupted_after_writing)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, "tiny", print)
    entry = conversion_dir(gguf)
    assert list(entry.parent.iterdir()) == []

    monkeypatch.setattr(conversion, "_write_conversion", write_conversion)
    assert convert_gguf(gguf, "tiny", print) == entry
    assert {path.name for path in entry.iterdir()} == CONVERTED_FILES


def test_a_copy_published_meanwhile_by_another_process_is_kept(gguf: Path, monkeypatch: pytest.MonkeyPatch):
    write_conversion = conversion._write_conversion
    entry = conversion_dir(gguf)

    def racing(source: Path, name: str, destination: Path) -> None:
        write_conversion(source, name, destination)
        entry.mkdir()
        (entry / "theirs").write_text("")

    monkeypatch.setattr(conversion, "_write_conversion", racing)
    assert convert_gguf(gguf, "tiny", print) == entry
    assert list(entry.parent.iterdir()) == [entry]
    assert [path.name for path in entry.iterdir()] == ["theirs"]


def test_partials_of_killed_conversions_are_swept_but_running_ones_kept(gguf: Path):
    folder = conversion_dir(gguf).parent
    killed, running = folder / ".partial-killed", folder / ".partial-running"
    killed.mkdir(parents=True)
    running.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(killed, (two_days_ago, two_days_ago))

    entry = convert_gguf(gguf, "tiny", print)
    assert sorted(folder.iterdir()) == sorted([entry, running])


def test_an_unsupported_architecture_is_refused_before_converting(tmp_path: Path):
    gguf = write_tiny_gguf(tmp_path / "tiny-gpt2.gguf", architecture="gpt2")
    notes: list[str] = []
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2' cannot stream: it uses learned absolute"):
        convert_gguf(gguf, "tiny-gpt2", notes.append)
    assert notes == []
    assert not (cache_root() / "converted").exists()


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError) as raised:
        convert_gguf(fake, str(fake), print)
    assert str(raised.value) == f"{fake} does not start with the GGUF magic bytes, so it is not a GGUF file."


def test_a_truncated_file_is_refused_before_converting(gguf: Path):
    whole = gguf.read_bytes()
    gguf.write_bytes(whole[: len(whole) // 2])
    notes: list[str] = []
    with pytest.raises(ModelAccessError) as raised:
        convert_gguf(gguf, "tiny", notes.append)
    assert str(raised.value) == (
        f"{gguf} is truncated or corrupt: it has {len(whole) // 2:,} bytes but its tensors end at byte "
        f"{len(whole):,}; delete it and download it again"
    )
    assert notes == []
    assert not (cache_root() / "converted").exists()


def test_a_cache_that_cannot_be_written_is_a_config_error(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A path below a regular file: no directory can be made there, whoever runs the test.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("STREAMCHAT_CACHE_DIR", str(blocker / "cache"))
    notes: list[str] = []
    with pytest.raises(ConfigError) as raised:
        convert_gguf(gguf, "tiny", notes.append)
    assert str(raised.value) == (
        f"cannot create {conversion_dir(gguf).parent} in streamchat's cache: Not a directory; "
        "set STREAMCHAT_CACHE_DIR to a writable directory"
    )
    assert notes == []
