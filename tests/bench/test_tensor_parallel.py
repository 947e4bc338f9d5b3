"""`streamchat bench speed --tp 2` on a tiny random llama: one process, then two, each a line with ms/token."""

import os
import re
import subprocess
import sys

import pytest

from tests.support.waiting import HANG_GUARD_SECONDS

LINE = r"decode \d+\.\d\d ms/token · {} on cpu · 16 tokens"


@pytest.mark.multiprocess
def test_bench_speed_tp_2_reports_decode_ms_per_token_for_one_process_and_for_two(tiny_chat_model):
    command = [sys.executable, "-m", "streamchat", "bench", "speed", "--tp", "2", "--model", str(tiny_chat_model)]
    command += ["--device", "cpu", "--dtype", "float32", "--window", "40", "--steps", "16"]
    result = subprocess.run(
        command, capture_output=True, timeout=HANG_GUARD_SECONDS, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(LINE.format("1 process"), lines[0])
    assert re.fullmatch(LINE.format(r"2 processes \(gloo\)"), lines[1])


def test_bench_speed_tp_refuses_random_weights_in_one_line():
    command = [sys.executable, "-m", "streamchat", "bench", "speed", "--tp", "2", "--random-init", "tiny"]
    result = subprocess.run(command, capture_output=True, timeout=HANG_GUARD_SECONDS)
    assert result.returncode == 2
    assert (
        result.stderr.decode() == "error: --tp loads --model's weights sharded: give --model instead of --random-init\n"
    )
