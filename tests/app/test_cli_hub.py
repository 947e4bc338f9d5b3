"""Hub models through the real `streamchat` command, against a local stand-in for huggingface.co."""

import hashlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
import torch
from safetensors.torch import load as load_safetensors

from tests.support.gguf_files import save_model_directory, write_tiny_gguf
from tests.support.waiting import HANG_GUARD_SECONDS

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_streamchat_test"


class FakeHub:
    """Serves one commit of `files` under every repository id, as huggingface.co serves a repository.

    It answers the calls huggingface_hub's snapshot_download makes: the revision's info,
    the file tree, and each file. With `error_code` it refuses every request the way the
    hub refuses a gated ("GatedRepo") or missing ("RepoNotFound") repository.
    """

    def __init__(self, files: dict[str, bytes], error_code: str | None = None, file_status: int = 200) -> None:
        self.files = files
        self.error_code = error_code
        self.file_status = file_status
        # (method, path, Authorization header) of every request, in order.
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub.answer(self, send_body=False)

            def do_GET(self) -> None:
                hub.answer(self, send_body=True)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def downloaded(self) -> list[str]:
        """The files fetched (GET, not HEAD), in order."""
        paths = [path for method, path, _ in self.requests if method == "GET"]
        return [match[1] for path in paths if (match := re.search(r"/resolve/\w+/(.+)$", path))]

    def answer(self, request: BaseHTTPRequestHandler, *, send_body: bool) -> None:
        path = request.path.split("?")[0]
        self.requests.append((request.command, path, request.headers.get("Authorization")))
        if self.error_code is not None:
            self.send(request, 401, b"", {"X-Error-Code": self.error_code}, send_body)
        elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/[^/]+", path):
            info = {"id": match[1], "sha": COMMIT, "siblings": [{"rfilename": name} for name in self.files]}
            self.send(request, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, send_body)
        elif re.fullmatch(r"/api/models/[^/]+/[^/]+/tree/[^/]+/?", path):
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()
            ]
            self.send(request, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body)
        elif (match := re.fullmatch(r"/[^/]+/[^/]+/resolve/[^/]+/(.+)", path)) and match[1] in self.files:
            data = self.files[match[1]]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            self.send(request, self.file_status, data, headers, send_body)
        else:
            self.send(request, 404, b"", {}, send_body)

    @staticmethod
    def send(
        request: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str], send_body: bool
    ) -> None:
        request.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            request.send_header(name, value)
        request.end_headers()
        if send_body:
            request.wfile.write(body)


@pytest.fixture(scope="module")
def tiny_model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files of a tiny chat model repository: the tiny GGUF as transformers reads it, saved once for this module."""
    root = tmp_path_factory.mktemp("repository")
    converted = save_model_directory(write_tiny_gguf(root / "tiny.gguf"), root / "tiny-model")
    return {path.name: path.read_bytes() for path in converted.iterdir()}


@pytest.fixture
def hubs() -> Iterator[list[FakeHub]]:
    started: list[FakeHub] = []
    yield started
    for hub in started:
        hub.server.shutdown()
        hub.server.server_close()


@pytest.fixture
def serve(hubs: list[FakeHub]):
    def start(files: dict[str, bytes], error_code: str | None = None, file_status: int = 200) -> FakeHub:
        hub = FakeHub(files, error_code, file_status)
        hubs.append(hub)
        return hub

    return start


def streamchat(*args: str, hub: FakeHub | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "COLUMNS": "250", "HF_TOKEN": TOKEN, **env}
    if hub is not None:
        environment |= {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"}
    command = [sys.executable, "-m", "streamchat", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=HANG_GUARD_SECONDS)


def test_an_alias_is_downloaded_into_the_hugging_face_cache_then_loads_offline(
    serve, tiny_model_files: dict[str, bytes]
):
    # Files a chat does not need, or may not load, are never fetched.
    hub = serve({**tiny_model_files, "pytorch_model.bin": b"pickle", "consolidated.safetensors": b"dup"})
    online = streamchat("info", "--model", "smollm2-360m", hub=hub)
    assert online.returncode == 0, online.stderr
    assert "source         Hugging Face hub HuggingFaceTB/SmolLM2-360M-Instruct" in online.stdout
    snapshot = Path(os.environ["HF_HOME"]) / "hub/models--HuggingFaceTB--SmolLM2-360M-Instruct/snapshots" / COMMIT
    assert f"files          {snapshot}" in online.stdout
    assert "Fetching 6 files" in online.stderr  # huggingface_hub's progress bar

    downloaded = hub.downloaded()
    assert downloaded[0] == "config.json"  # checked before anything else is fetched
    assert sorted(downloaded) == sorted(tiny_model_files)
    authorizations = {auth for _, path, auth in hub.requests if "/SmolLM2-360M-Instruct/" in path}
    assert authorizations == {f"Bearer {TOKEN}"}  # HF_TOKEN goes with every request for the repository

    hub.requests.clear()
    offline = streamchat("info", "--model", "smollm2-360m", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert hub.requests == []
    models = streamchat("models", HF_HUB_OFFLINE="1").stdout.splitlines()
    row = next(line for line in models if line.startswith("smollm2-360m "))
    assert row.rstrip().split(maxsplit=2) == [
        "smollm2-360m",
        "HuggingFaceTB/SmolLM2-360M-Instruct",
        "yes, in the Hugging Face cache",
    ]


def test_an_unsupported_hub_model_is_refused_before_its_weights_are_fetched(serve):
    hub = serve({"config.json": json.dumps({"model_type": "gpt2"}).encode(), "model.safetensors": b"weights"})
    result = streamchat("info", "-m", "openai-community/gpt2", hub=hub)
    assert result.returncode == 5
    assert result.stderr.splitlines()[-1].startswith("error: model type 'gpt2' cannot stream")
    assert hub.downloaded() == ["config.json"]


def test_pickled_hub_weights_are_fetched_only_with_allow_pickle(serve, tiny_model_files: dict[str, bytes]):
    pickled = io.BytesIO()
    torch.save(load_safetensors(tiny_model_files["model.safetensors"]), pickled)
    files = {name: data for name, data in tiny_model_files.items() if name != "model.safetensors"}
    hub = serve({**files, "pytorch_model.bin": pickled.getvalue()})

    refused = streamchat("info", "-m", "lmsys/vicuna-7b-v1.3", hub=hub)
    assert refused.returncode == 4
    assert refused.stderr.splitlines()[-1] == (
        "error: lmsys/vicuna-7b-v1.3 has no safetensors weights (model*.safetensors). If it ships pickled "
        "weights (pytorch_model*.bin) and you trust its publisher, pass --allow-pickle."
    )
    assert "pytorch_model.bin" not in hub.downloaded()

    allowed = streamchat("info", "-m", "lmsys/vicuna-7b-v1.3", "--allow-pickle", hub=hub)
    assert allowed.returncode == 0, allowed.stderr
    assert "pytorch_model.bin" in hub.downloaded()


@pytest.mark.parametrize(
    ("error_code", "exit_code", "message"),
    [
        (
            "GatedRepo",
            4,
            "error: meta-llama/Llama-2-7b-chat-hf is gated: accept its terms on {endpoint}/"
            "meta-llama/Llama-2-7b-chat-hf, then log in with `hf auth login` or set HF_TOKEN",
        ),
        (
            "RepoNotFound",
            3,
            "error: no model meta-llama/Llama-2-7b-chat-hf on the Hugging Face hub; check the spelling, "
            "run `streamchat models` for aliases, or if it is private, log in with `hf auth login` or set "
            "HF_TOKEN",
        ),
    ],
)
def test_a_refused_repository_says_how_to_get_access(serve, error_code: str, exit_code: int, message: str):
    hub = serve({}, error_code=error_code)
    result = streamchat("info", "-m", "llama-2-7b-chat", hub=hub)
    assert result.returncode == exit_code
    assert result.stderr == message.format(endpoint=hub.endpoint) + "\n"
    assert (f"Bearer {TOKEN}") in {auth for _, _, auth in hub.requests}


@pytest.mark.parametrize("status", [401, 403])
def test_a_token_without_permission_for_the_files_is_reported(serve, tiny_model_files: dict[str, bytes], status: int):
    hub = serve(tiny_model_files, file_status=status)
    result = streamchat("info", "-m", "owner/private-model", hub=hub)
    assert result.returncode == 4
    assert result.stderr.splitlines()[-1] == (
        f"error: the Hugging Face hub answered {status} for owner/private-model; "
        "log in with `hf auth login` or set HF_TOKEN"
    )
