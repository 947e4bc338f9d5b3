"""Fetching models from the Hugging Face hub into huggingface_hub's own cache.

Downloads go through `snapshot_download`, so HF_HOME, HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT
and HF_HUB_OFFLINE all behave as in every other Hugging Face tool, a cached model loads
without the network, and its progress bars show. Only the files a chat needs are fetched:
the config, the tokenizer, the chat template and the weights streamchat may load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from streamchat.errors import ModelAccessError, ModelNotFoundError
from streamchat.loading.configs import read_supported_config
from streamchat.loading.weights import has_loadable_weights, weight_patterns

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError

# Everything but the weights; "model*" in the weight pattern skips duplicate checkpoints
# such as Mistral's 14 GB consolidated.safetensors.
_SUPPORT_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
# Custom modelling code, fetched only when the user trusts it.
_REMOTE_CODE = ["*.py"]
_LOGIN_HINT = "log in with `hf auth login` or set HF_TOKEN"


def download_model(
    repo_id: str, *, allow_pickle: bool, trust_remote_code: bool, offline_remedy: str | None = None
) -> Path:
    """The local snapshot directory of `repo_id`, downloading what is missing.

    The config comes first and is checked, so an unsupported architecture is refused
    before gigabytes of weights are fetched. `offline_remedy` is what to do when the hub
    cannot be asked and the cache lacks the model, where there is a better way than the
    usual advice (a package that ships it).
    """
    code = _REMOTE_CODE if trust_remote_code else []
    config_only = _snapshot(repo_id, ["config.json", *code], offline_remedy)
    read_supported_config(config_only, repo_id, trust_remote_code=trust_remote_code)
    return _snapshot(repo_id, [*_SUPPORT_FILES, *weight_patterns(allow_pickle=allow_pickle), *code], offline_remedy)


def is_cached(repo_id: str) -> bool:
    """Whether `repo_id` would load offline with the default options (no network is used)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = [*_SUPPORT_FILES, *weight_patterns(allow_pickle=False)]
    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError:
        return False
    return has_loadable_weights(snapshot, allow_pickle=False)


def _snapshot(repo_id: str, patterns: list[str], offline_remedy: str | None = None) -> Path:
    """`snapshot_download`, with its failures turned into one-line domain errors."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except GatedRepoError as error:
        raise ModelAccessError(
            f"{repo_id} is gated: accept its terms on {constants.ENDPOINT}/{repo_id}, then {_LOGIN_HINT}"
        ) from error
    except RepositoryNotFoundError as error:
        # The hub answers 401 both for missing repositories and for private ones without a token.
        raise ModelNotFoundError(
            f"no model {repo_id} on the Hugging Face hub; check the spelling, run `streamchat models` "
            f"for aliases, or if it is private, {_LOGIN_HINT}"
        ) from error
    except LocalEntryNotFoundError as error:
        # Raised when the hub could not be asked or did not answer usefully, and the cache
        # does not hold a complete copy.
        if isinstance(error.__cause__, HfHubHTTPError):
            raise _refused(repo_id, error.__cause__) from error
        if constants.is_offline_mode():
            raise ModelAccessError(
                f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                + (
                    offline_remedy
                    or "unset it to download, or pass a local directory or .gguf file (`streamchat models` shows "
                    "what is available offline)"
                )
            ) from error
        raise ModelAccessError(
            f"cannot reach the Hugging Face hub at {constants.ENDPOINT} to download {repo_id}, and it is not "
            "cached; "
            + (
                offline_remedy
                or "check the connection, pass a local directory or .gguf file, run `streamchat models` to see "
                "what is available offline, or set HF_HUB_OFFLINE=1 to use the cache only"
            )
        ) from error
    except HfHubHTTPError as error:
        raise _refused(repo_id, error) from error


def _refused(repo_id: str, error: HfHubHTTPError) -> ModelAccessError:
    status = error.response.status_code
    hint = _LOGIN_HINT if status in (401, 403) else "try again later"
    return ModelAccessError(f"the Hugging Face hub answered {status} for {repo_id}; {hint}")
