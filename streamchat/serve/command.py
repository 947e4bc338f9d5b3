"""`streamchat serve`: load the model once, then answer the OpenAI chat API until Ctrl-C or SIGTERM.

The model options are `run`'s (declared once in streamchat.interface.options; the config
file and the environment apply as for run). A --host other than a loopback address needs an
API key: without one the command says so in one line, before anything binds. On Ctrl-C or
SIGTERM every reply in flight stops and is journaled, every live conversation's state is
written beside its journal, and the command exits 0 (Ctrl-C) or 143 (SIGTERM).
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.interface.config import load_run_config
from streamchat.interface.options import (
    AllowPickleOption,
    DeviceMapOption,
    DeviceOption,
    DtypeOption,
    KeepOption,
    KvCacheOption,
    ModelOption,
    QuantizeOption,
    RecallOption,
    TrustRemoteCodeOption,
    WindowOption,
    given_options,
    option,
)
from streamchat.interface.reporting import reported_errors

SERVER_PANEL = "Server"
# The options only `serve` has; the rest are run's, resolved by interface.config.
SERVER_OPTIONS = (
    "host",
    "port",
    "api_key",
    "max_conversations",
    "max_waiting",
    "max_wait_seconds",
    "max_tokens_limit",
    "cors",
)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """A server other machines can reach needs a key; ConfigError otherwise."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(
            f"--host {host} is reachable from other machines: give an --api-key (or {defaults.SERVE_API_KEY_ENV}), "
            f"or serve on {defaults.SERVE_HOST}"
        )


def serve(
    context: typer.Context,
    model: ModelOption = None,
    keep: KeepOption = None,
    window: WindowOption = None,
    recall: RecallOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = None,
    allow_pickle: AllowPickleOption = None,
    host: Annotated[
        str, option(f"Address to listen on. \\[default: {defaults.SERVE_HOST}]", panel=SERVER_PANEL, metavar="HOST")
    ] = defaults.SERVE_HOST,
    port: Annotated[
        int, option(f"Port. \\[default: {defaults.SERVE_PORT}]", panel=SERVER_PANEL, metavar="PORT")
    ] = defaults.SERVE_PORT,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=defaults.SERVE_API_KEY_ENV,
            help="Every endpoint but /health wants `Authorization: Bearer KEY`. Needed for a non-loopback --host.",
            metavar="KEY",
            rich_help_panel=SERVER_PANEL,
            show_default=False,
            show_envvar=True,
        ),
    ] = None,
    max_conversations: Annotated[
        int,
        option(
            "Conversations with a live cache; past that the least recently used idle one is parked on disk "
            f"(restored exactly when asked for). \\[default: {defaults.SERVE_MAX_CONVERSATIONS}]",
            panel=SERVER_PANEL,
            metavar="N",
        ),
    ] = defaults.SERVE_MAX_CONVERSATIONS,
    max_waiting: Annotated[
        int,
        option(
            f"Requests that may wait in line beyond those answered, first come first served; more get 429. "
            f"\\[default: {defaults.SERVE_MAX_WAITING}]",
            panel=SERVER_PANEL,
            metavar="N",
        ),
    ] = defaults.SERVE_MAX_WAITING,
    max_wait_seconds: Annotated[
        float,
        option(
            "How long a request may wait in line for a conversation to be free before it gets 429 (0: no limit). "
            f"\\[default: {defaults.SERVE_MAX_WAIT_SECONDS:g}]",
            panel=SERVER_PANEL,
            metavar="SECONDS",
        ),
    ] = defaults.SERVE_MAX_WAIT_SECONDS,
    max_tokens_limit: Annotated[
        int | None,
        option(
            "The most tokens any reply may have: a request's larger max_tokens is clamped to it (and the reply "
            "says so in X-Streamchat-Warning). \\[default: the window]",
            panel=SERVER_PANEL,
            metavar="N",
        ),
    ] = None,
    cors: Annotated[
        list[str] | None,
        option(
            "Let browser pages from ORIGIN call the API (repeat for several). Off by default.",
            panel=SERVER_PANEL,
            metavar="ORIGIN",
        ),
    ] = None,
) -> None:
    """Serve endless conversations over an OpenAI-compatible HTTP API (chat completions, streamed or whole)."""
    given = given_options(context)
    with reported_errors():
        check_exposure(host, api_key)
        if max_conversations < 1 or max_waiting < 0 or not 0 < port < 65536 or not max_wait_seconds >= 0:
            raise ConfigError(
                "--max-conversations must be >= 1, --max-waiting >= 0, --max-wait-seconds >= 0, --port from 1 to 65535"
            )
        if max_tokens_limit is not None and max_tokens_limit < 1:
            raise ConfigError(f"--max-tokens-limit must be a whole number >= 1, got {max_tokens_limit}")
        config = load_run_config({name: value for name, value in given.items() if name not in SERVER_OPTIONS})
    # Imported here: `streamchat --help` starts without torch, starlette or uvicorn.
    from streamchat.serve.http import HttpOptions
    from streamchat.serve.server import WaitingLine, run_server

    options = HttpOptions(api_key=api_key or None, cors=tuple(cors or ()))
    with reported_errors():
        waiting = WaitingLine(max_waiting, max_wait_seconds or None)
        code = run_server(config, host, port, max_conversations, waiting, options, max_tokens_limit)
    raise typer.Exit(code)
