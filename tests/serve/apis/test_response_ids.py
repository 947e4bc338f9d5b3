"""Response ids name where a response stands in its conversation; previous_response_id reads it from the journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamchat.serve.apis.request import ApiError
from streamchat.serve.apis.response_ids import conversation_until, response_id

CONVERSATION = "20250101-120000-3fa2c1"


def test_an_id_is_its_conversation_and_message_count() -> None:
    assert response_id(CONVERSATION, 4) == f"resp_{CONVERSATION}_4"


@pytest.mark.parametrize(
    "text",
    [
        f"{CONVERSATION}_2",
        f"resp_{CONVERSATION}",
        f"resp_{CONVERSATION}_",
        f"resp_{CONVERSATION}_1",
        f"resp_{CONVERSATION}_02",
        f"resp_{CONVERSATION}_٢",
        f"resp_{CONVERSATION}_{'2' * 40}",
        "resp_../../x_2",
        "resp__2",
    ],
)
def test_an_id_this_server_did_not_write_is_a_400(tmp_path: Path, text: str) -> None:
    with pytest.raises(ApiError) as refused:
        conversation_until(tmp_path, text)
    assert (refused.value.status, refused.value.param) == (400, "previous_response_id")


def test_an_id_whose_conversation_is_gone_or_unreadable_is_a_404(tmp_path: Path) -> None:
    with pytest.raises(ApiError) as missing:
        conversation_until(tmp_path, f"resp_{CONVERSATION}_2")
    assert missing.value.status == 404
    (tmp_path / f"{CONVERSATION}.jsonl").write_text("not a journal\n")
    with pytest.raises(ApiError) as unreadable:
        conversation_until(tmp_path, f"resp_{CONVERSATION}_2")
    assert unreadable.value.status == 404 and "\n" not in unreadable.value.message
