"""scripts/engine_scaling_figures.py, run whole on random weights in a tiny shape: a line per row count."""

from __future__ import annotations

import json
import sys

from tests.support.scripts import load_script

figures = load_script("engine_scaling_figures")

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


def test_the_figures_have_a_line_per_row_count_against_the_first(tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    arguments = ["--random-init", str(config), "--device", "cpu", "--dtype", "float32", "--quantize", "none"]
    arguments += ["--rows", "1,3", "--rounds", "1", "--context", "24", "--prompt", "8", "--window", "64"]
    monkeypatch.setattr(sys, "argv", ["engine_scaling_figures.py", *arguments])
    figures.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"random {config}, float32, cpu, {figures.torch.get_num_threads()} threads"
    assert lines[1] == "decode, caches of 16+24 tokens; prompts of 8 tokens read at once"
    one, three = (line.split() for line in lines[3:])
    assert (one[0], one[2], one[4], one[6]) == ("1", "1.00", "1.00", "1.00")  # one row against itself
    assert three[0] == "3" and float(three[3]) > 0 and float(three[5]) > 0
