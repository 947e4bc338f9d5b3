"""llama.cpp beside streamchat: which GGUF file it reads for a --model, and the process that only loads it."""

import importlib.util
import sys

import pytest

from streamchat.measure.llama_cpp import LOAD_CONTEXT, llama_cpp_gguf, load_command

INSTALLED = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.skipif(INSTALLED, reason="llama-cpp-python is installed here")
def test_without_llama_cpp_python_there_is_no_row_and_the_note_says_how_to_get_one(tmp_path):
    assert llama_cpp_gguf(str(tmp_path / "m.gguf")) == (
        None,
        "llama.cpp row skipped: llama-cpp-python is not installed (pip install 'streamchat[llamacpp]')",
    )


@pytest.mark.skipif(not INSTALLED, reason="llama-cpp-python is not installed")
def test_llama_cpp_reads_a_gguf_file_given_and_nothing_else(tmp_path):
    assert llama_cpp_gguf(str(tmp_path / "m.gguf")) == (tmp_path / "m.gguf", "")
    assert llama_cpp_gguf(str(tmp_path)) == (None, f"llama.cpp row skipped: {tmp_path} is not a GGUF file")


def test_the_load_process_loads_the_file_with_a_chats_context_and_says_when_it_has(tmp_path):
    command = load_command(tmp_path / "m.gguf")
    assert command[0] == sys.executable and command[1] == "-c"
    assert command[3:] == [str(tmp_path / "m.gguf"), "2048"] and LOAD_CONTEXT == 2048
    script = command[2]
    compile(script, "<llama.cpp load>", "exec")  # a script that runs, not just a string
    assert "n_ctx=int(sys.argv[2])" in script and "n_threads=os.cpu_count()" in script
    assert script.index("Llama(") < script.index("print('loaded', flush=True)")
