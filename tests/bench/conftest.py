from pathlib import Path

import pytest

from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer

# A tiny llama with room for every id of the offline byte-level tokenizer.
VOCAB = 700
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want. "


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama and a tokenizer saved as a model directory that `--model DIR` loads."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama", vocab_size=VOCAB).save_pretrained(directory)
    byte_level_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """A text long enough for the quick perplexity run."""
    path = tmp_path / "novel.txt"
    path.write_text(TEXT * 40, encoding="utf-8")
    return path
