"""What `--model` names: an alias, a local model directory, a .gguf file or a hub id.

Resolution only looks at the alias table and the file system: it never touches the
network or loads anything, so it is instant and its errors come before any slow step.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from streamchat import defaults
from streamchat.errors import ModelNotFoundError
from streamchat.loading.aliases import ALIASES, PACKAGED_GGUFS, closest_aliases

SourceKind = Literal["gguf", "directory", "hub"]

# owner/name, as the hub spells repository ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files come from."""

    kind: SourceKind
    # An absolute path for "gguf" and "directory", a repository id for "hub".
    location: str
    # What the user asked for: the alias or the --model text.
    name: str

    @property
    def path(self) -> Path:
        return Path(self.location)


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a --model value (None for the default) into a ModelSource, or explain why not.

    Aliases win over same-named paths; an existing path wins over a hub id of the same
    spelling, as in transformers' own `from_pretrained`.
    """
    name = defaults.DEFAULT_MODEL if spec is None else spec.strip()
    if not name:
        raise ModelNotFoundError("--model is empty; pass an alias (see `streamchat models`), a hub id or a path")
    alias = name.lower()
    if alias in ALIASES:
        return _resolve_alias(alias)

    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{name} is a file but not a .gguf; pass a .gguf file or a model directory")
        return ModelSource("gguf", str(path.resolve()), name)
    if path.is_dir():
        return ModelSource("directory", str(_model_directory(path, name)), name)
    if _looks_like_path(name):
        raise ModelNotFoundError(f"no such file or directory: {name}")
    if _HUB_ID.fullmatch(name):
        return ModelSource("hub", name, name)

    suggestions = closest_aliases(name)
    did_you_mean = f"; did you mean {_one_of(suggestions)}?" if suggestions else "."
    raise ModelNotFoundError(
        f"unknown model alias '{name}'{did_you_mean} Run `streamchat models` for the aliases, "
        "or pass a hub id (owner/name), a model directory or a .gguf file."
    )


def packaged_gguf(alias: str) -> Path | None:
    """The GGUF file an installed package ships for `alias`, or None.

    The package is found without importing it: it only carries a data file.
    """
    if alias not in PACKAGED_GGUFS:
        return None
    package, filename = PACKAGED_GGUFS[alias]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    return None


def _resolve_alias(alias: str) -> ModelSource:
    gguf = packaged_gguf(alias)
    if gguf is not None:
        return ModelSource("gguf", str(gguf.resolve()), alias)
    return ModelSource("hub", ALIASES[alias], alias)


def _model_directory(path: Path, name: str) -> Path:
    if (path / "config.json").is_file():
        return path.resolve()
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        raise ModelNotFoundError(f"{name} has no config.json; to load a GGUF, pass the file itself: {ggufs[0]}")
    raise ModelNotFoundError(f"{name} has no config.json, so it is not a transformers model directory")


def _one_of(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _looks_like_path(name: str) -> bool:
    # A hub id is exactly owner/name, so anything else with separators, or a .gguf, means a path.
    return name.lower().endswith(".gguf") or name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
