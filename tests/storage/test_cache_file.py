"""The cache state file: written atomically, used only for the run and the conversation it was saved for."""

import dataclasses
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from streamchat.conversation.state import TensorState
from streamchat.errors import SessionFileError
from streamchat.generation.settings import GenerationSettings
from streamchat.storage.cache_file import StateKey, read_state, state_path, write_state
from streamchat.storage.session_file import SavedSession

KEY = StateKey("/models/tiny", "abc123", "float32", "cpu", "none", "system", 2000)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
SAVED = SavedSession(MESSAGES, "Be kind.", {"seed": "7", "temperature": "0.7"}, "token", "tiny")
TENSORS = {"cache.ledger": torch.arange(10), "sampler.random_state": torch.zeros(16, dtype=torch.uint8)}


def write(path, key=KEY, saved=SAVED, tensors=TENSORS):
    return write_state(path, saved.state(GenerationSettings(), TensorState(tensors, 7)), key)


def test_the_state_lives_beside_its_session_file(tmp_path):
    journal = tmp_path / "20250101-120000-3fa2c1.jsonl"
    assert state_path(journal) == tmp_path / "20250101-120000-3fa2c1.cache.safetensors"
    assert state_path(tmp_path / "copy.json") == tmp_path / "copy.cache.safetensors"


def test_a_state_written_is_read_back_with_its_seed_and_says_what_it_is_for(tmp_path):
    path = tmp_path / "s.cache.safetensors"
    size = write(path)
    assert size == path.stat().st_size
    state = read_state(path, KEY, SAVED)
    assert isinstance(state, TensorState) and state.seed == 7
    assert all(torch.equal(state.tensors[name], tensor) for name, tensor in TENSORS.items())
    with safe_open(str(path), framework="pt") as opened:
        metadata = opened.metadata()
    assert {key: metadata[key] for key in ("format", "version", "model", "keep", "window", "messages", "seed")} == {
        "format": "streamchat-cache",
        "version": "1",
        "model": "/models/tiny",
        "keep": "system",
        "window": "2000",
        "messages": "2",
        "seed": "7",
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # conversations are private


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model": "/models/other"}, "its cache state was saved for model /models/tiny, this run has /models/other"),
        ({"weights": "def456"}, "its cache state was saved for other weights of this model (its files changed since)"),
        ({"dtype": "bfloat16"}, "its cache state was saved for dtype float32, this run has bfloat16"),
        ({"device": "cuda"}, "its cache state was saved for device cpu, this run has cuda"),
        ({"quantization": "int8"}, "its cache state was saved for quantization none, this run has int8"),
        ({"keep": "4"}, "its cache state was saved for --keep system, this run has 4"),
        ({"window": 256}, "its cache state was saved for --window 2000, this run has 256"),
        ({"kv_cache": "int8"}, "its cache state was saved for --kv-cache full, this run has int8"),
    ],
)
def test_a_state_for_another_run_is_not_used_and_says_why(tmp_path, change, reason):
    path = tmp_path / "s.cache.safetensors"
    write(path)
    assert read_state(path, dataclasses.replace(KEY, **change), SAVED) == reason


def test_a_state_saved_before_the_kv_format_was_recorded_holds_a_full_window(tmp_path):
    path = tmp_path / "s.cache.safetensors"
    write(path)
    saved = load_file(str(path))
    with safe_open(str(path), framework="pt") as opened:
        metadata = dict(opened.metadata())
    del metadata["kv_cache"]  # as streamchat wrote it before --kv-cache
    save_file(saved, path, metadata)
    assert isinstance(read_state(path, KEY, SAVED), TensorState)
    assert read_state(path, dataclasses.replace(KEY, kv_cache="int8"), SAVED) == (
        "its cache state was saved for --kv-cache full, this run has int8"
    )


def test_a_state_older_than_the_conversation_s_last_turn_is_not_used(tmp_path):
    path = tmp_path / "s.cache.safetensors"
    write(path)
    later = dataclasses.replace(SAVED, messages=[*MESSAGES, *MESSAGES])
    assert read_state(path, KEY, later) == (
        "its cache state holds 2 messages of the 4 in the session: it is older than the conversation's last turn"
    )
    changed = dataclasses.replace(SAVED, messages=[MESSAGES[0], {"role": "assistant", "content": "Hi!"}])
    assert read_state(path, KEY, changed) == (
        "its cache state holds another version of the conversation (changed after the state was saved)"
    )
    reseeded = dataclasses.replace(SAVED, settings={"seed": "8"})
    assert read_state(path, KEY, reseeded).startswith("its cache state holds another version")
    assert isinstance(read_state(path, KEY, dataclasses.replace(SAVED, settings={"seed": "7"})), TensorState)


def test_a_missing_or_damaged_state_says_why(tmp_path):
    path = tmp_path / "s.cache.safetensors"
    assert read_state(path, KEY, SAVED).startswith("no cache state was saved beside it")
    write(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut short, as no write of streamchat's leaves it
    assert read_state(path, KEY, SAVED).startswith("its cache state cannot be read (")
    path.write_bytes(b"not a state at all")
    assert read_state(path, KEY, SAVED).startswith("its cache state cannot be read (")


def test_a_failed_write_leaves_the_previous_state_and_no_temporary_file(tmp_path):
    path = tmp_path / "s.cache.safetensors"
    write(path)
    before = path.read_bytes()
    with pytest.raises(ValueError):
        write(path, tensors={"x": torch.zeros(4, 4).t()})  # not contiguous: safetensors refuses it mid-write
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["s.cache.safetensors"]


def test_a_state_that_cannot_be_written_is_one_line_naming_the_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SessionFileError, match=r"^cannot save the cache state to .*/file/s\.cache\.safetensors: "):
        write(blocker / "s.cache.safetensors")
