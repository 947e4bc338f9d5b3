"""scripts/message_path_modules.py on a scripted tiny model: the modules a REPL message and a served request cross.

The lists are exact: a change that adds a module to a message's way (or takes one off) says so here, as the
layering test says where imports may point. The tiny model is fused as the default model is at load, so its steps
take the lean pass too; in float32 they call no native kernel, so only the modules outside the forward pass are held.
"""

from __future__ import annotations

import copy

import pytest

from streamchat.placement.fusion import fuse_projections
from tests.support.model_dirs import scripted_model_and_tokenizer
from tests.support.scripts import load_script

paths = load_script("message_path_modules")

THE_CONVERSATION = {
    "conversation.session",
    "generation.driver",
    "generation.token_loop",
    "generation.requests",
    "generation.decoder",
    "engine.engine",
    "cache.sink_cache",
    "cache.snapshots",
}


@pytest.fixture(scope="module")
def scripted():
    model, tokenizer = scripted_model_and_tokenizer(("Sure", ":", " the", " answer", " is", " 42", "."))
    model = copy.deepcopy(model)  # fusing works in place; the scripted model is shared
    fuse_projections(model)
    return model, tokenizer


def test_a_repl_message_crosses_the_app_the_conversation_s_eight_and_the_screen_and_journal(scripted):
    app = {"app.chat", "interface.display", "storage.journal"}
    assert paths.outside_forward_pass(paths.repl_path(*scripted)) == {*app, *THE_CONVERSATION}


def test_a_served_request_crosses_the_server_s_five_the_conversation_s_eight_and_the_journal(scripted):
    server = {"serve.http", "serve.apis.request", "serve.matching", "serve.turn", "serve.worker"}
    assert paths.outside_forward_pass(paths.served_path(*scripted)) == {*server, "storage.journal", *THE_CONVERSATION}


def test_the_report_counts_the_forward_pass_apart():
    lines = paths.report("REPL message", {"app.chat", "engine.engine", "placement.native"})
    assert lines == [
        "REPL message: 3 modules, 2 outside the forward pass and 1 in it",
        "  app.chat engine.engine",
        "  forward pass: placement.native",
    ]
