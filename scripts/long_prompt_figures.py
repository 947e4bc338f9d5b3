#!/usr/bin/env python3
"""How long a one-line 1 MB prompt takes: to tokenise, and to its first reply token through `streamchat run`.

    .venv/bin/python scripts/long_prompt_figures.py                  # default window, then --window 60
    .venv/bin/python scripts/long_prompt_figures.py --window 60 --read-all

Tokenising is timed in-process on the default model's tokenizer (the encode alone, and the
whole prompt as the chat template cuts it). The first token is timed from outside: the
script pipes `python3 -c "print('x'*1000000)"` into the installed `streamchat run` next to
this Python and notes when the first byte of the reply reaches stdout, so the figure
includes starting Python and loading the model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_BYTES = 1_000_000
REPLY_MARK = b"\n\nASSISTANT: "


def tokenising() -> None:
    from streamchat.conversation.template import ChatFormat
    from streamchat.loading import LoadOptions, load_model

    tokenizer = load_model(LoadOptions()).tokenizer
    text = "x" * PROMPT_BYTES
    for label, encode in (
        ("encode", lambda: tokenizer.encode(text, add_special_tokens=False)),
        ("prompt_ids", lambda: ChatFormat(tokenizer).prompt_ids(text, first_turn=True)),
    ):
        started = time.perf_counter()
        ids = encode()
        print(f"tokenising 1 MB ({label}): {time.perf_counter() - started:.2f} s, {len(ids):,} tokens", flush=True)


def first_token(options: list[str]) -> None:
    streamchat = Path(sys.executable).parent / "streamchat"
    command = f"python3 -c \"print('x'*{PROMPT_BYTES})\" | {streamchat} run {' '.join(options)}"
    started = time.perf_counter()
    process = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    while REPLY_MARK not in seen or len(seen) <= seen.index(REPLY_MARK) + len(REPLY_MARK):
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        seen = (seen + chunk)[-4096:]
    answered = time.perf_counter() - started
    process.kill()
    process.wait()
    notes = process.stderr.read().decode().strip()
    print(f"{command}\n  first reply byte after {answered:.1f} s; stderr: {notes or '(nothing)'}", flush=True)


def main(arguments: list[str]) -> None:
    if arguments:
        first_token(arguments)
        return
    tokenising()
    first_token([])
    first_token(["--window", "60"])


if __name__ == "__main__":
    main(sys.argv[1:])
