"""`streamchat bench keep`: the probe's figure, the two caches, and the command end to end."""

import csv

import pytest
import torch
from typer.testing import CliRunner

from streamchat.bench import keep
from streamchat.bench.commands import bench_app
from streamchat.conversation.template import ChatFormat
from streamchat.errors import ConfigError
from tests.bench.conftest import VOCAB
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer

TURNS = ["Hello there!", "What is the capital of France?", "Tell me about the sea."]


@pytest.fixture(scope="module")
def conversation():
    sizes = keep.KeepSizes(turns=3, window=64, reply_tokens=12)
    model = tiny_model("llama", vocab_size=VOCAB)
    return keep.generate_conversation(model, byte_level_tokenizer(), TURNS, sizes, on_turn=lambda number: None)


def test_the_probe_is_the_answer_s_mean_log_probability_after_the_question(conversation):
    model, tokenizer = tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer()
    run = keep.read_with(model, tokenizer, conversation[:2], "system", window=400)  # nothing is evicted
    chat_format = ChatFormat(tokenizer, system_prompt=keep.SYSTEM_PROMPT)
    first = chat_format.prompt_ids(TURNS[0], first_turn=True) + chat_format.reply_ids(conversation[1]["content"])
    question = chat_format.prompt_ids(keep.QUESTION, first_turn=False)
    answer = tokenizer.encode(keep.ANSWER, add_special_tokens=False)
    ids = first + question + answer
    with torch.inference_mode():
        log_probs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)  # dense, no cache at all
    start = len(first) + len(question)
    expected = torch.stack([log_probs[start - 1 + i, token] for i, token in enumerate(answer)]).mean().item()
    assert run.log_probs == [pytest.approx(expected, abs=1e-4)]


def test_without_evictions_both_caches_see_the_same_and_with_them_only_keep_system_keeps_the_system_turn(conversation):
    model, tokenizer = tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer()
    roomy = [keep.read_with(model, tokenizer, conversation, policy, window=400) for policy in keep.POLICIES]
    assert roomy[0].evicted == roomy[1].evicted == 0
    assert roomy[0].log_probs == pytest.approx(roomy[1].log_probs, abs=1e-5)
    system, four = (keep.read_with(model, tokenizer, conversation, policy, window=48) for policy in keep.POLICIES)
    assert (system.kept, four.kept) == (36, 4) and four.evicted > 0
    assert system.log_probs != four.log_probs


def test_too_few_turns_are_refused_before_the_model_loads():
    with pytest.raises(ConfigError, match=r"^the transcript holds 2 user turns, fewer than --turns 3; lower --turns$"):
        keep.user_turns(iter(["a", "b"]), 3)
    assert keep.user_turns(iter(["a", "b", "c", "d"]), 3) == ["a", "b", "c"]


def test_keep_quick_writes_the_table_the_csv_files_and_the_plot(tiny_model_dir, tmp_path):
    transcript = tmp_path / "turns.txt"
    transcript.write_text("\n".join(TURNS) + "\n", encoding="utf-8")
    out = tmp_path / "results"
    arguments = ["keep", "--quick", "--transcript", str(transcript), "--model", str(tiny_model_dir), "--out", str(out)]
    result = CliRunner().invoke(bench_app, arguments, env={"COLUMNS": "250"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # the title wraps at the table's width
    assert "3 turns of turns.txt through a 64-token window" in output
    assert "keep system - keep 4, answer log-prob after the last turn:" in output
    with (out / "keep.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["keep"], row["cache"]) for row in rows] == [("system", "36+64"), ("4", "4+64")]
    with (out / "keep-curve.csv").open(newline="") as file:
        curve = list(csv.DictReader(file))
    assert [row["turn"] for row in curve] == ["1", "2", "3"] and set(curve[0]) == {"turn", "keep_system", "keep_4"}
    assert (out / "keep.png").read_bytes().startswith(b"\x89PNG")
