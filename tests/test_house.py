"""The house's measured goals: no import cycle, few private names of other libraries, one composition per Hydra pass."""

import ast
from pathlib import Path

import pytest

from tests.helpers import QUICK, REPO, train_here

SOURCES = sorted([*(REPO / "src").rglob("*.py"), *(REPO / "hydra_plugins").rglob("*.py")])
PROJECT = ("src", "hydra_plugins")
# Names with a leading underscore that are public: Hydra's config keys and os._exit, which the docs offer for children.
PUBLIC = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_", "_exit"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, at its top or inside a function: both run in the end."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found |= submodules or {node.module}
    return {name for name in found if name in modules and name.split(".")[0] in PROJECT}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def private_names(path: Path, modules: set[str]) -> list[str]:
    """`x._name` where `x` is not the class's own object nor a project module, and `getattr(x, "_name")`."""
    tree = ast.parse(path.read_text())
    project_aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").split(".")[0] in PROJECT for alias in node.names}
    found = []
    for node in ast.walk(tree):
        name, owner = None, None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__"):
            name, owner = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and not node.args[1].value.endswith("__")):
            name, owner = node.args[1].value, node.args[0]
        if name is None or name in PUBLIC:
            continue
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in project_aliases):
            continue
        found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(owner)}.{name}")
    return found


def test_no_import_cycle_among_the_project_modules():
    modules = {module_name(path) for path in SOURCES}
    graph = {module_name(path): project_imports(path, modules) - {module_name(path)} for path in SOURCES}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_at_most_five_private_names_of_other_libraries_each_with_a_reason():
    modules = {module_name(path) for path in SOURCES}
    found = [use for path in SOURCES for use in private_names(path, modules)]
    names = {use.rpartition(".")[2] for use in found}
    assert len(names) <= 5, "\n".join(found)
    for use in found:
        path, line = use.split(" ")[0].split(":")
        lines = (REPO / path).read_text().splitlines()
        nearby = "\n".join(lines[max(0, int(line) - 4):int(line)])
        assert "#" in nearby, f"{use}: no comment says why no public way exists"


def compositions(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """How often `python -m src.train <args>` composes its config: its own entry, in this process."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    load, count = ConfigLoaderImpl.load_configuration, []

    def counted(self, *rest, **kwargs):
        count.append(rest)
        return load(self, *rest, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(ConfigLoaderImpl, "load_configuration", counted)
        result = train_here(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return len(count)


def test_a_run_and_its_resume_compose_the_config_as_hydra_main_does_twice(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert compositions(monkeypatch, *QUICK, f"hydra.run.dir={run}") == 2
    assert (run / "result.json").is_file()
    assert compositions(monkeypatch, "ckpt_path=last", f"hydra.run.dir={run}") == 2


# Calls that open, write or remove files by path, which under a run, sweep or study folder go through src/folders.py:
# Path's methods, os's and shutil's functions, and the built-in `open`.
PATH_METHODS = {"open", "write_text", "write_bytes", "read_text", "read_bytes", "unlink", "rmdir", "rename",
                "symlink_to", "hardlink_to", "touch"}
OS_FUNCTIONS = {"open", "remove", "unlink", "rmdir", "replace", "rename", "truncate", "mkfifo", "symlink", "link",
                "rmtree"}
# The calls outside the layer, by module and what they touch: none of them a run, sweep or study folder's contents.
OUTSIDE_FOLDERS = {
    "src/records.py": {"read_text"},  # conf/ of the checkout
    "src/loggers.py": {"open"},  # the MLflow store's lock, beside the store
    "src/callbacks/disturbance.py": {"read_text"},  # /proc
    "src/callbacks/hardware.py": {"write_text", "read_text"},  # /proc/self
    "src/sysinfo.py": {"read_text"},  # /proc/cpuinfo
    "src/launch/load.py": {"read_text"},  # /proc
    "src/scaling/probe.py": {"read_text", "write_text"},  # the probe's own temporary folder
    "src/launch/workers.py": {"read_text", "write_text", "open"},  # the launch's temporary folder, /proc
    "src/launch/parallel_launcher.py": {"os.open"},  # the job's output, made through the layer before the job starts
}


def file_calls(path: Path) -> set[str]:
    """The file-touching calls in `path`: `x.read_text()`, `os.replace(...)`, `shutil.rmtree(...)`, `open(...)`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        if isinstance(function, ast.Name) and function.id == "open":
            found.add("open")
        elif isinstance(function, ast.Attribute):
            module = function.value.id if isinstance(function.value, ast.Name) else None
            if module in ("os", "shutil") and function.attr in OS_FUNCTIONS or module not in ("os", "shutil") \
                    and function.attr in PATH_METHODS:
                found.add(f"{module}.{function.attr}" if module in ("os", "shutil") else function.attr)
    return found


def test_files_under_a_folder_are_touched_through_one_layer():
    """Every read and write of a run, sweep or study folder's files passes src/folders.py; a new call elsewhere fails
    here until it goes through the layer or is listed as touching no such folder."""
    calls = {path.relative_to(REPO).as_posix(): file_calls(path) for path in SOURCES}
    outside = {name: found for name, found in calls.items() if found and name != "src/folders.py"}
    assert {name: found - OUTSIDE_FOLDERS.get(name, set()) for name, found in outside.items()
            if found - OUTSIDE_FOLDERS.get(name, set())} == {}
