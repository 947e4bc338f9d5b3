"""What recall is measured on: every shipped fact is found by its question, and a search's cost is timed."""

from streamchat.conversation.recall import RecallIndex
from streamchat.measure.recall_facts import search_costs, shipped_facts


def test_every_shipped_fact_is_found_by_its_question_and_no_distractor_clears_the_bar():
    facts, distractors = shipped_facts()
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
    facts, _ = shipped_facts()
    costs = search_costs(facts, ["Tell me about the sea."], ["The sea is wide."], (10, 100), repeats=1)
    assert [turns for turns, _, _ in costs] == [10, 100]
    assert all(built > 0 and search > 0 for _, built, search in costs)
