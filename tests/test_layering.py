"""The house's floors, read from the imports: no module imports from a floor above its own.

cache < placement < weights < loading < engine < generation < conversation < storage < distributed < interface
< sessions < measure < app, bench, serve < cli < __main__. The app, the
bench and the server share a floor and import nothing from each other; the cache imports only torch,
transformers and streamchat.errors.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "streamchat"
# Each floor's folders (or top-level modules); a floor may import from its own folder and every floor below.
FLOORS = [
    {"__init__", "defaults", "errors"},
    {"cache"},
    {"placement"},
    {"weights"},
    {"loading"},
    {"engine"},
    {"generation"},
    {"conversation"},
    {"storage"},
    {"distributed"},
    {"interface"},
    {"sessions"},
    {"measure"},
    {"app", "bench", "serve"},
    {"cli"},
    {"__main__"},
]
CACHE_MAY_IMPORT = {"torch", "transformers", "streamchat.errors"}


def part_of(module: str) -> str:
    """The folder (or top-level module) of a streamchat module: streamchat.cache.ledger -> cache."""
    return module.split(".")[1] if "." in module else "__init__"


def floor_of(part: str) -> int:
    return next(index for index, parts in enumerate(FLOORS) if part in parts)


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (lazy imports count too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from streamchat.cache import masks` imports the module streamchat.cache.masks; a name that is
            # no module (`from streamchat import __version__`) comes from the package itself.
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            modules = names & MODULES.keys()
            found.update(modules)
            if len(modules) < len(names) or not node.module.startswith("streamchat"):
                found.add(node.module)
    return found


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_folder_has_a_floor() -> None:
    assert {part_of(name) for name in MODULES if name != "streamchat"} <= set().union(*FLOORS)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_runs_up_or_across(name: str) -> None:
    importer = part_of(name)
    wrong = []
    for imported in sorted(imports_of(MODULES[name])):
        if imported == "streamchat" or not imported.startswith("streamchat."):
            continue
        target = part_of(imported)
        upward = floor_of(target) > floor_of(importer)
        across = floor_of(target) == floor_of(importer) and target != importer and importer not in FLOORS[0]
        if upward or across:
            wrong.append(imported)
    assert wrong == [], f"{name} imports from a floor above it or beside it"


@pytest.mark.parametrize("name", sorted(name for name in MODULES if part_of(name) == "cache"))
def test_the_cache_imports_only_torch_transformers_and_errors(name: str) -> None:
    outside = {
        imported
        for imported in imports_of(MODULES[name])
        if imported.split(".")[0] not in sys.stdlib_module_names and not imported.startswith("streamchat.cache")
    }
    assert {imported for imported in outside if not imported.startswith(tuple(CACHE_MAY_IMPORT))} == set()


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("def later():\n    from streamchat.app.chat import ChatLoop\nfrom streamchat import defaults\n")
    assert imports_of(module) == {"streamchat.app.chat", "streamchat.defaults"}
    assert floor_of(part_of("streamchat.app.chat")) > floor_of(part_of("streamchat.conversation.session"))


def test_no_module_of_streamchat_takes_part_in_an_import_cycle():
    """Through any import at all, TYPE_CHECKING and lazy ones included: a module reaches itself again never."""
    graph = {
        name: {imported for imported in imports_of(path) if imported in MODULES and imported != name}
        for name, path in MODULES.items()
    }
    # A package's __init__ re-exports its modules: importing it is no arrow back to them.
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for target in sorted(graph[node]):
                if target == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*trail, target]))
    assert cycles == []


def test_no_folder_holds_more_than_twelve_modules():
    crowded = {
        folder.name: count
        for folder in PACKAGE.iterdir()
        if folder.is_dir() and (count := len(list(folder.glob("*.py")))) > 12
    }
    assert crowded == {}


# "About 400 lines": a module may run a little over where a split would cut one idea in two.
MOST_LINES = 420


def test_no_module_is_much_over_four_hundred_lines():
    long = {name: lines for name, path in MODULES.items() if (lines := len(path.read_text().splitlines())) > MOST_LINES}
    assert long == {}


# What touching a file takes: a conversation hands its values to streamchat.storage instead.
FILE_MODULES = {"os", "io", "pathlib", "tempfile", "shutil", "safetensors", "fcntl", "streamchat.storage"}


@pytest.mark.parametrize("name", sorted(name for name in MODULES if part_of(name) == "conversation"))
def test_the_conversation_does_no_file_io(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    opens = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "open"]
    touching = {imported for imported in imports_of(MODULES[name]) if imported.startswith(tuple(FILE_MODULES))}
    assert (opens, touching) == ([], set())


def test_every_folder_is_a_package():
    # A folder without __init__.py is a namespace package, which a non-editable install leaves out.
    folders = {path.parent for path in PACKAGE.rglob("*.py")} - {PACKAGE}
    assert {folder for folder in folders if not (folder / "__init__.py").is_file()} == set()
