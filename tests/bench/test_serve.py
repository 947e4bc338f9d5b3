"""`streamchat bench serve`: a real `streamchat serve` started, conversations resent, rows, CSV, the skip note."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streamchat.bench import serve as bench
from streamchat.bench.commands import bench_app
from streamchat.errors import ConfigError
from streamchat.measure.chat_client import Reply, TurnRecord


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or []), list(reader)


def test_serve_quick_runs_two_conversations_of_three_turns(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STREAMCHAT_DATA_DIR", str(tmp_path / "user-data"))
    # A key the user serves with is not the bench's: its loopback server wants none.
    monkeypatch.setenv("STREAMCHAT_API_KEY", "the-users-key")
    out = tmp_path / "results"
    result = CliRunner().invoke(
        bench_app,
        ["serve", "--quick", "--model", str(tiny_model_dir), "--device", "cpu", "--out", str(out)],
        env={"COLUMNS": "300"},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    # Without llama-cpp-python, or with it: a directory model is no GGUF for llama.cpp either way.
    assert "llama.cpp row skipped: " in result.output
    assert "3 turns, at most 8 tokens a reply" in result.output and "streamchat window 96" in result.output

    header, rows = _read(out / "serve.csv")
    assert header == [column.key for column in bench.columns()]
    assert [(row["server"], row["conversations"], row["requests"], row["errors"]) for row in rows] == [
        ("streamchat", "2", "6", "0")
    ]
    assert rows[0]["system_prompt"] == "kept" and float(rows[0]["tokens_per_second"]) > 0
    # The server's KV cache as its /v1/models says: the tiny model's 2 layers x 2 KV heads of 16 dims, a window
    # of 96, in the format `serve` settled on (int8 where the kernels run, else its float32).
    token_bytes = {"int8": 2 * 2 * 2 * (16 + 4), "full": 2 * 2 * 2 * 16 * 4}[rows[0]["kv_cache"]]
    assert float(rows[0]["kv_mb_full"]) == pytest.approx(token_bytes * 96 / 1e6)
    assert float(rows[0]["decode_each"]) > 0 and float(rows[0]["ttft_p95"]) >= float(rows[0]["ttft_p50"]) > 0

    header, requests = _read(out / "serve-requests.csv")
    assert header == list(bench.REQUEST_COLUMNS)
    assert [(row["conversation"], row["turn"]) for row in requests] == [
        (conversation, turn) for conversation in "12" for turn in "123"
    ]
    first_turns_cached = []
    for row in requests:
        prompt, cached, read = int(row["prompt_tokens"]), int(row["cached_tokens"]), int(row["read_tokens"])
        assert read == prompt - cached and row["error"] == ""
        assert 1 <= int(row["tokens"]) <= 8
        if row["turn"] == "1":
            first_turns_cached.append(cached)
            assert read > 0
        else:
            # The history was not read again: only the new message (and the turn's template tokens).
            assert 0 < read < prompt - 50 and cached > 0
    # Both conversations begin with the same system turn (the cache's sinks): one reads it, the other copies it.
    first_reader, copier = sorted(first_turns_cached)
    assert first_reader == 0 and copier > 0
    # The bench's servers write their conversations into a directory of their own, removed after.
    assert not (tmp_path / "user-data").exists()


def test_a_server_that_fails_to_start_is_one_line(tmp_path) -> None:
    result = CliRunner().invoke(
        bench_app,
        ["serve", "--quick", "--model", str(tmp_path / "missing"), "--device", "cpu", "--out", str(tmp_path)],
        env={"COLUMNS": "300"},
    )
    assert result.exit_code == 2
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert error_lines == [
        f"error: streamchat server exited with code 3: no such file or directory: {tmp_path / 'missing'}"
    ]
    assert "Traceback" not in result.output


def test_llama_cpp_command_lines(tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    binary = tmp_path / "build" / "bin" / "llama-server"
    native = bench.llama_cpp_server(gguf, 2048, 4, binary, context_shift=True)
    assert native.command_line(9000)[1:] == [
        "-m",
        str(gguf),
        "--port",
        "9000",
        "--host",
        "127.0.0.1",
        "-c",
        "8192",
        "-np",
        "4",
        "--context-shift",
    ]
    assert dict(native.environment)["LD_LIBRARY_PATH"].split(":")[0] == str(binary.parent)
    python = bench.llama_cpp_server(gguf, 2048, 4, None, context_shift=False)
    assert python.command_line(9000)[1:] == [
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--port",
        "9000",
        "--host",
        "127.0.0.1",
        "--n_ctx",
        "2048",
    ]
    assert python.health_path == "/v1/models"


def test_the_llama_cpp_row_says_why_it_is_skipped(tmp_path) -> None:
    binary = tmp_path / "llama-server"
    assert "is not a file" in bench.llama_cpp_gguf("smollm2-135m", binary)[1]
    binary.write_bytes(b"")
    assert bench.llama_cpp_gguf(str(tmp_path / "m.gguf"), binary) == (tmp_path / "m.gguf", "")
    assert bench.llama_cpp_gguf("qwen2.5-0.5b", binary) == (
        None,
        "llama.cpp row skipped: qwen2.5-0.5b is not a GGUF file",
    )


def test_a_row_counts_errors_empty_replies_and_reads_the_late_turns() -> None:
    replies = {
        1: Reply(text="a", ttft=1.0, tokens=4, prompt_tokens=100, cached_tokens=0),
        2: Reply(text="b", ttft=0.2, tokens=4, prompt_tokens=150, cached_tokens=120),
        3: Reply(text="", ttft=None, tokens=0),
        4: Reply(error="HTTP 400: too long"),
    }
    records = [TurnRecord(1, turn, reply) for turn, reply in replies.items()]
    row = bench.summary_row("llama.cpp", 1, 4, records, seconds=2.0, system_prompt=None)
    assert row["requests"] == 4 and row["errors"] == 1 and row["empty"] == 1 and row["first_failed_turn"] == 3
    assert row["tokens_per_second"] == 4.0
    assert row["ttft_early_p50"] == 0.2 and row["ttft_late_p50"] == 0.2
    assert (row["prompt_late"], row["read_late"]) == (150, 30)


def test_percentiles_interpolate() -> None:
    assert bench.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert bench.percentile([1.0, 2.0], 0.95) == pytest.approx(1.95)
    assert bench.percentile([], 0.5) is None
    assert list(bench.late_turns(40)) == list(range(31, 41)) and list(bench.late_turns(3)) == [2, 3]


def test_conversations_are_a_list_of_whole_numbers() -> None:
    assert bench.parse_conversations("1, 2,4") == (1, 2, 4)
    with pytest.raises(ConfigError, match="--conversations 1,x"):
        bench.parse_conversations("1,x")
    with pytest.raises(ConfigError, match="--conversations 0: must be at least 1"):
        bench.ServeSizes(conversations=(0,), turns=1, max_new_tokens=1, n_ctx=512)


def test_each_conversation_s_decode_speed_and_the_rows_against_one_conversation() -> None:
    assert bench.decode_speed(Reply(text="a", ttft=0.5, seconds=2.5, tokens=9)) == 4.0
    assert bench.decode_speed(Reply(text="a", ttft=0.5, seconds=0.5, tokens=1)) is None
    assert bench.decode_speed(Reply(error="HTTP 500")) is None
    one = [TurnRecord(1, 1, Reply(text="a", ttft=0.1, seconds=2.1, tokens=21))]
    eight = [TurnRecord(c, 1, Reply(text="a", ttft=0.3, seconds=4.3, tokens=21)) for c in range(1, 9)]
    rows = [
        bench.summary_row("streamchat", 1, 1, one, seconds=2.1, system_prompt="kept"),
        bench.summary_row("streamchat", 8, 1, eight, seconds=4.3, system_prompt="kept"),
    ]
    bench.against_one(rows)
    assert rows[0]["decode_each"] == 10.0 and rows[1]["decode_each"] == 5.0
    assert rows[1]["decode_each_vs_alone"] == 0.5
    assert rows[1]["throughput_vs_one"] == pytest.approx((168 / 4.3) / (21 / 2.1))
    assert rows[0]["ttft_p50"] == 0.1 and rows[1]["ttft_p95"] == pytest.approx(0.3)
    assert bench.parse_conversations("1,2,4,8,16") == (1, 2, 4, 8, 16)
