"""The code base stays ruff clean: lint and format are part of the test suite."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    arguments = [sys.executable, "-m", "ruff", *command, "streamchat", "tests", "scripts"]
    result = subprocess.run(arguments, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
