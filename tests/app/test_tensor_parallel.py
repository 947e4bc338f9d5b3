"""`streamchat run --tp` through the real console script: 2 CPU ranks (gloo), a tiny random llama.

Each test starts real processes: the --tp N launcher, or torchrun. They are marked
`multiprocess` (`pytest -m multiprocess` runs just these). Replies are greedy, with a
window small enough that the cache evicts mid-reply.
"""

import os
import signal
import subprocess
import sys

import pexpect
import psutil
import pytest

from streamchat.app.tensor_parallel import with_optional_tp_value
from streamchat.conversation.session import SessionOptions
from streamchat.distributed.supervisor import free_port
from streamchat.generation.events import Evicted, TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.safe_text import safe_plain
from tests.support.sessions import session_under_test
from tests.support.waiting import HANG_GUARD_SECONDS, read_at_least

OPTIONS = ["--max-new-tokens", "30", "--temperature", "0", "--window", "40", "--dtype", "float32", "--quantize", "none"]
TURNS = ["Hello there", "How are you?", "Tell me a story."]


def rank_env(tmp_path):
    # One thread per rank: the CI machine has two cores, and pytest runs two workers.
    return {**os.environ, "OMP_NUM_THREADS": "1", "STREAMCHAT_DATA_DIR": str(tmp_path)}


def expected_transcript(model_dir):
    """The conversation in one process, in-process: what every --tp run must print, byte for byte."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    settings = GenerationSettings(max_new_tokens=30, temperature=0.0)
    session = session_under_test(
        model, AutoTokenizer.from_pretrained(model_dir), SessionOptions(window=40, settings=settings)
    )
    replies, evicted = [], 0
    for turn in TURNS:
        events = list(session.chat(turn))
        evicted += sum(event.count for event in events if isinstance(event, Evicted))
        replies.append(next(event for event in events if isinstance(event, TurnFinished)).reply)
    assert evicted > 0, "the window should be small enough for evictions"
    pairs = zip(TURNS, replies, strict=True)
    return "\n".join(f"USER: {safe_plain(turn)}\n\nASSISTANT: {safe_plain(reply)}\n" for turn, reply in pairs)


def descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(processes):
    _, alive = psutil.wait_procs(processes, timeout=HANG_GUARD_SECONDS)
    assert not alive, f"left running: {alive}"


@pytest.mark.multiprocess
def test_a_piped_transcript_under_tp_2_is_byte_identical_to_one_process(tiny_chat_model, tmp_path):
    stdin = "\n".join(TURNS).encode() + b"\n"
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS, "--tp", "2"]
    result = subprocess.run(
        command, input=stdin, capture_output=True, timeout=HANG_GUARD_SECONDS, env=rank_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == expected_transcript(tiny_chat_model)
    assert result.stderr == b""  # the other rank printed nothing, and rank 0 only the transcript
    assert len(list((tmp_path / "sessions").glob("*.jsonl"))) == 1  # one journal: rank 0's


@pytest.mark.multiprocess
def test_two_nodes_on_one_machine_give_the_same_transcript(tiny_chat_model, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "streamchat-test"]
    streamchat = ["-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS, "--tp"]
    env = rank_env(tmp_path)
    nodes = [
        subprocess.Popen(
            [*torchrun, *streamchat],
            stdin=subprocess.PIPE if node == 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for node in range(2)
    ]
    transcript = "\n".join(TURNS).encode() + b"\n"
    try:
        first, second = (
            node.communicate(transcript if node is nodes[0] else None, timeout=HANG_GUARD_SECONDS) for node in nodes
        )
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        stderr = "\n".join(node.communicate()[1].decode() for node in nodes)
        pytest.fail(f"torchrun ran past {HANG_GUARD_SECONDS:g} s; its stderr:\n{stderr}")
    assert [node.returncode for node in nodes] == [0, 0], first[1].decode() + second[1].decode()
    outputs = sorted([first[0].decode(), second[0].decode()], key=len)
    assert outputs[0] == ""  # the node without rank 0 prints nothing on stdout
    assert outputs[1] == expected_transcript(tiny_chat_model)


def spawn_chat_under_tp_2(model_dir, tmp_path):
    """The REPL with --tp 2 in a pty."""
    env = {**rank_env(tmp_path), "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"}
    arguments = ["-m", "streamchat", "run", "--model", str(model_dir), *OPTIONS, "--tp", "2"]
    return pexpect.spawn(
        sys.executable, arguments, env=env, dimensions=(30, 110), timeout=HANG_GUARD_SECONDS, encoding="utf-8"
    )


@pytest.mark.multiprocess
def test_the_repl_under_tp_2_takes_a_turn_a_reset_a_turn_and_ctrl_d(tiny_chat_model, tmp_path):
    chat = spawn_chat_under_tp_2(tiny_chat_model, tmp_path)
    try:
        chat.expect_exact("streamchat 0.1.0")
        ranks = descendants(chat.pid)
        assert len(ranks) == 2
        chat.expect_exact("›")
        chat.send("Hello there, tell me something.\r")
        chat.expect(r"forgot \d+ tokens?")
        chat.expect_exact("30 tokens ·")
        chat.expect_exact("›")
        chat.send("/reset\r")
        chat.expect_exact("conversation and cache cleared")
        chat.expect_exact("›")
        chat.send("Are you still there?\r")
        chat.expect_exact("30 tokens ·")
        chat.expect(r"4 sinks \| 40/40 window")  # a fresh conversation filled the window again
        chat.expect_exact("›")
        chat.sendcontrol("d")
        chat.expect(r"2 turns · [\d,]+ tokens streamed · [\d,]+ evicted · saved to ")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before  # after EOF: the last lines, the launcher's included
    assert_all_gone(ranks)


@pytest.mark.multiprocess
def test_ctrl_c_regen_set_and_system_under_tp_2_keep_every_rank_in_step(tiny_chat_model, tmp_path):
    chat = spawn_chat_under_tp_2(tiny_chat_model, tmp_path)
    try:
        chat.expect_exact("streamchat 0.1.0")
        ranks = descendants(chat.pid)
        chat.expect_exact("›")
        chat.send("/set max_new_tokens 100000\r")
        chat.expect_exact("max_new_tokens = 100000")
        chat.expect_exact("›")
        chat.send("Now talk for a long time.\r")
        chat.expect(r"forgot \d+ tokens?")
        chat.sendintr()
        chat.sendintr()  # a second Ctrl-C stops the reply too: it never tears a step off on rank 0 alone
        chat.expect_exact("· stopped")
        assert "abandoned" not in chat.before
        chat.expect_exact("›")
        chat.send("/set max_new_tokens 5\r")
        chat.expect_exact("max_new_tokens = 5")
        chat.expect_exact("›")
        chat.send("/regen\r")
        chat.expect_exact("5 tokens ·")
        chat.expect_exact("›")
        chat.send("/system Be brief.\r")
        chat.expect(r"replayed 2 messages \([\d,]+ tokens\)")
        chat.expect_exact("›")
        chat.send("Are you still there?\r")
        chat.expect_exact("5 tokens ·")
        chat.expect_exact("›")
        chat.sendcontrol("d")
        chat.expect(r"3 turns · ")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before  # after EOF: the last lines, the launcher's included
    assert_all_gone(ranks)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("rank", "sent", "line"),
    [
        ("1", signal.SIGKILL, "error: rank 1 was killed by SIGKILL; every rank stopped"),
        ("0", signal.SIGKILL, "error: rank 0 was killed by SIGKILL; every rank stopped"),
        # A hung rank: the others give up on it after the step timeout (3 s here).
        ("1", signal.SIGSTOP, "error: rank 1 stopped answering (rank 0 lost the other ranks while "),
    ],
    ids=["rank 1 killed", "rank 0 killed", "rank 1 hung"],
)
def test_a_rank_killed_or_hung_mid_reply_ends_the_run_with_one_line(tiny_chat_model, tmp_path, rank, sent, line):
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS, "--tp", "2"]
    command += ["--max-new-tokens", "1000000"]  # the tiny model never ends a reply by itself
    env = {**rank_env(tmp_path), "STREAMCHAT_TP_STEP_TIMEOUT": "3"}
    launcher = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    launcher.stdin.write(b"Talk for a long time.\n")
    launcher.stdin.flush()  # closed by communicate() below (Python 3.11 refuses to communicate over a closed stdin)
    head = read_at_least(launcher, len(b"USER: Talk for a long time.\n\nASSISTANT: "))
    assert head.startswith(b"USER:"), head
    read_at_least(launcher, 20)  # the reply is streaming: both ranks are decoding
    ranks = descendants(launcher.pid)
    victim = next(process for process in ranks if process.environ().get("RANK") == rank)
    victim.send_signal(sent)
    # The run ends by itself (a hung rank is given up on after the step timeout); only a hang meets the guard.
    _, stderr = (output.decode() for output in launcher.communicate(timeout=HANG_GUARD_SECONDS))
    assert launcher.returncode == 9
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith(line), stderr
    assert_all_gone(ranks)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("sent", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_stops_the_reply_and_ends_every_rank(tiny_chat_model, tmp_path, sent, code):
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS, "--tp", "2"]
    command += ["--max-new-tokens", "1000000"]
    launcher = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=rank_env(tmp_path)
    )
    launcher.stdin.write(b"Talk for a long time.\nAnd again.\n")
    launcher.stdin.flush()
    read_at_least(launcher, len(b"USER: Talk for a long time.\n\nASSISTANT: ") + 20)
    ranks = descendants(launcher.pid)
    launcher.send_signal(sent)
    stdout = launcher.communicate(timeout=HANG_GUARD_SECONDS)[0].decode()
    assert launcher.returncode == code
    assert stdout.endswith("\n") and "And again." not in stdout  # the reply ended whole, and the run with it
    assert_all_gone(ranks)


def test_tp_alone_means_as_many_ranks_as_torchrun_started():
    assert with_optional_tp_value(["run", "--tp"]) == ["run", "--tp", "auto"]
    assert with_optional_tp_value(["run", "--tp", "--model", "x"]) == ["run", "--tp", "auto", "--model", "x"]
    assert with_optional_tp_value(["run", "--tp", "2"]) == ["run", "--tp", "2"]
    assert with_optional_tp_value(["run"]) == ["run"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--tp", "2", "--device-map", "auto"], "error: --tp and --device-map auto both spread the model; give one"),
        (["--tp", "2", "--quantize", "int8"], "error: --quantize int8 cannot be used with --tp"),
        (["--tp"], "error: --tp without a number joins the processes torchrun started, and this is not one"),
        (["--tp", "0"], "error: --tp 0: must be a number of ranks >= 1"),
    ],
)
def test_what_tp_cannot_do_is_refused_in_one_line_before_any_rank_starts(tiny_chat_model, options, message):
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tiny_chat_model), *options]
    result = subprocess.run(command, input=b"Hi\n", capture_output=True, timeout=HANG_GUARD_SECONDS)
    assert result.returncode == 2
    assert len(result.stderr.decode().strip().splitlines()) == 1
    assert result.stderr.decode().startswith(message)


def test_a_model_without_a_tensor_parallel_plan_is_refused_in_one_line_naming_those_with_one(tmp_path):
    from tests.support.models import tiny_model
    from tests.support.tokenizers import byte_level_tokenizer

    tiny_model("stablelm", vocab_size=700).save_pretrained(tmp_path / "stablelm")
    byte_level_tokenizer().save_pretrained(tmp_path / "stablelm")
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tmp_path / "stablelm"), "--tp", "2"]
    result = subprocess.run(command, input=b"Hi\n", capture_output=True, timeout=HANG_GUARD_SECONDS)
    assert result.returncode == 5
    assert result.stderr.decode().splitlines() == [
        f"error: {tmp_path / 'stablelm'} (stablelm) has no tensor-parallel plan in transformers, so --tp cannot "
        "shard it; model types with one: cohere, gemma, gemma2, gemma3_text, gpt_neox, granite, llama, mistral, "
        "mixtral, olmo2, phi, phi3, qwen2, qwen3, starcoder2"
    ]
