"""`streamchat bench recall`: the shipped facts, the search's cost, and the command end to end on a tiny model."""

import csv

from typer.testing import CliRunner

from streamchat.bench import recall
from streamchat.bench.commands import bench_app
from streamchat.conversation.recall import RecallIndex


def test_every_shipped_fact_is_found_by_its_question_and_no_distractor_clears_the_bar():
    facts, distractors = recall.shipped_facts()
    assert len(facts) == 10 and len(distractors) == 6
    index = RecallIndex()
    for number, fact in enumerate(facts):
        index.add(2 * number, "user", fact.statement)
        index.add(2 * number + 1, "assistant", "Noted.")
    for number, fact in enumerate(facts):
        assert [passage.message for passage in index.search(fact.question)][:1] == [2 * number], fact.question
    for item in distractors:
        assert index.search(item.question) == [], item.question


def test_search_costs_index_every_turn_and_time_a_search():
    facts, _ = recall.shipped_facts()
    costs = recall.search_costs(facts, ["Tell me about the sea."], ["The sea is wide."], recall.QUICK)
    assert [turns for turns, _, _ in costs] == [10, 100]
    assert all(built > 0 and search > 0 for _, built, search in costs)


def test_recall_quick_writes_the_table_the_csv_files_and_the_plot(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    arguments = ["recall", "--quick", "--model", str(tiny_model_dir), "--out", str(out)]
    result = CliRunner().invoke(bench_app, arguments, env={"COLUMNS": "250"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "2 facts through a 160-token window" in output
    assert "share of the log-prob gap recall recovers:" in output
    with (out / "recall.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["question"] for row in rows] == [
        "What is my sister's name?",
        "What is the door code?",
        "mean over the facts",
        "distractor: What is my brother's name?",
    ]
    with (out / "recall-cost.csv").open(newline="") as file:
        costs = list(csv.DictReader(file))
    assert [row["turns"] for row in costs] == ["8", "10", "100"]
    assert (out / "recall.png").read_bytes().startswith(b"\x89PNG")
