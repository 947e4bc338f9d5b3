"""The calls a conversation accepts: ChatSession answers them all, and each move survives the trip between ranks."""

import pickle

from streamchat.conversation.calls import (
    Chat,
    Conversation,
    Move,
    Recover,
    Regenerate,
    Replay,
    Reset,
    Restore,
    SetSystemPrompt,
    UpdateSettings,
)
from streamchat.conversation.session import SessionOptions
from streamchat.conversation.state import ConversationState
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer

ANSWERED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
EXAMPLES = [
    Chat("Hello"),
    Regenerate(),
    Recover(),
    Reset(),
    SetSystemPrompt("Be brief."),
    SetSystemPrompt(None),
    UpdateSettings({"temperature": 0.5, "stop": ("a b",)}),
    Replay(ANSWERED),
    Restore(ConversationState(ANSWERED, "Be kind.", GenerationSettings(temperature=0.5)), "no cache state"),
]


def test_a_chat_session_is_a_conversation_that_steps_alone():
    session = session_under_test(tiny_model("llama", vocab_size=700), byte_level_tokenizer(), SessionOptions(window=30))
    assert isinstance(session, Conversation)
    assert not session.steps_in_lockstep


def test_every_move_comes_back_from_a_pickle_as_it_was_sent():
    # torch.distributed's broadcast_object_list pickles each request rank 0 sends.
    assert {type(move) for move in EXAMPLES} == set(Move.__subclasses__())
    assert [pickle.loads(pickle.dumps(move)) for move in EXAMPLES] == EXAMPLES
