"""The code base stays ruff clean: lint and format are part of the test suite."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    result = subprocess.run(
        [RUFF, *command, "streamchat", "tests", "scripts"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
