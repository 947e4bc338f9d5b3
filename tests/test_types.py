"""The type checker passes over streamchat/ as pyproject.toml configures it (strict in cache/, engine/, generation/)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_type_checker_finds_no_error_in_streamchat():
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    checked = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-6000:] + checked.stderr[-2000:]
    assert checked.stdout.startswith("Success: no issues found")
