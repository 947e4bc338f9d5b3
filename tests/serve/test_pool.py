"""One store for both faces, and bounded memory: journals `run` reads and writes, parking and exact restores."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from streamchat.cli import app
from streamchat.conversation.session_options import SessionOptions
from streamchat.generation.events import TurnFinished
from streamchat.storage.cache_file import state_path, write_state
from streamchat.storage.journal import Journal
from streamchat.storage.session_file import read_session
from tests.serve.conftest import KEY, SETTINGS, wait_idle
from tests.serve.test_turn import new_turn_tokens
from tests.support.sessions import session_under_test


def interleaved(server, tokenizer, turns: int = 3) -> list[str]:
    """Two conversations, A and B, a turn of each in turn, each resent whole; the replies in order."""
    histories = {"A": [], "B": []}
    replies = []
    for turn in range(turns):
        for name, history in histories.items():
            history.append({"role": "user", "content": f"{name} asks {turn}"})
            reply = server.client.chat.completions.create(model="tiny", messages=history, max_tokens=6)
            usage = reply.usage
            read = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
            # Parked or not, a conversation goes on exactly: only the new turn is read, never a replay.
            assert read == new_turn_tokens(tokenizer, f"{name} asks {turn}", turn == 0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            replies.append(reply.choices[0].message.content)
    return replies


def turn_finished(events) -> TurnFinished:
    (finished,) = [event for event in events if isinstance(event, TurnFinished)]
    return finished


def test_parked_conversations_go_on_exactly_as_if_never_parked(start_server, endless) -> None:
    live = start_server(endless, window=48, max_conversations=4)
    parking = start_server(endless, window=48, max_conversations=1)
    assert interleaved(parking, endless[1]) == interleaved(live, endless[1])
    # Each was parked beside its journal (and restored from there) while the other answered.
    assert len(list(parking.sessions.glob("*.cache.safetensors"))) == 2
    assert list(live.sessions.glob("*.cache.safetensors")) == []
    listed = parking.http.get(f"{parking.url}/v1/conversations").json()["data"]
    assert sorted(entry["state"] for entry in listed) == ["live", "parked"]


def test_a_client_gone_mid_stream_stops_the_reply_and_keeps_it(start_server, endless) -> None:
    server = start_server(endless)
    body = {"messages": [{"role": "user", "content": "Go on and on."}], "stream": True, "max_tokens": 5000}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        conversation = response.headers["x-streamchat-conversation"]
        lines = response.iter_lines()
        received = [next(lines) for _ in range(8)]
    wait_idle(server)
    path = server.sessions / f"{conversation}.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    reply = records[-1]
    assert (reply["type"], reply["stop_reason"]) == ("reply", "interrupted")
    streamed = "".join(
        json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content", "") for line in received if line
    )
    assert reply["content"].startswith(streamed) and reply["content"] and len(reply["content"]) < 5000
    assert read_session(path).messages[-1] == {"role": "assistant", "content": reply["content"]}


def test_a_session_saved_by_run_is_continued_exactly_and_listed(start_server, endless, tmp_path, monkeypatch) -> None:
    model, tokenizer = endless
    sessions = tmp_path / "data" / "sessions"
    session = session_under_test(model, tokenizer, SessionOptions(keep=4, window=64, settings=SETTINGS))
    journal = Journal(sessions, "tiny", {"keep": 4, "window": 64}, on_error=print)
    history = []
    for text in ("First from run.", "Second from run."):
        journal.record_user(session.snapshot(tensors=False), text)
        finished = turn_finished(session.chat(text))
        journal.record(session.snapshot(tensors=False), finished.stats.stop_reason)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": finished.reply}]
    write_state(state_path(journal.path), session.snapshot(), KEY)
    journal.close()
    saved_id = journal.path.stem
    expected = turn_finished(session.chat("Third, by the server."))

    server = start_server(endless, sessions=sessions)
    messages = [*history, {"role": "user", "content": "Third, by the server."}]
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=messages)
    reply = raw.parse()
    assert raw.headers["x-streamchat-conversation"] == saved_id
    assert reply.choices[0].message.content == expected.reply  # restored exactly: the same reply run would give
    usage = reply.usage
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == expected.stats.prompt_tokens

    served = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "A new one."}]
    )
    monkeypatch.setenv("STREAMCHAT_DATA_DIR", str(tmp_path / "data"))
    listed = json.loads(CliRunner().invoke(app, ["sessions", "--json"]).stdout)
    turns = {Path(record["path"]).stem: record["turns"] for record in listed}
    assert turns == {saved_id: 3, served.headers["x-streamchat-conversation"]: 1}
    saved = read_session(sessions / f"{saved_id}.jsonl")
    assert saved.messages == [*messages, {"role": "assistant", "content": expected.reply}]
