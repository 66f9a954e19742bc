"""The imports between the project's modules form no cycle, and each package imports only the
packages docs/design.md allows it; the launcher (``launch``, not installed) is one package that
nothing installed imports, and its shell wrappers embed no Python. tests/ mirrors the packages.

Read from the source (``ast``), so function-local imports count as much as module-level ones.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import EXCLUSIVE_FILES, FILES_FIRST, FILES_LAST

from search_env.paths import REPO_ROOT

PACKAGES = (
    "search_env",
    "search_demo",
    "cpu_engine",
    "eval",
    "reward_fns",
    "patches",
    "cpu_compat",
    "launch",
    "study",
)
ALLOWED = {
    "reward_fns": set(),
    "cpu_compat": set(),
    "search_env": {"reward_fns"},
    "cpu_engine": {"search_env"},
    "search_demo": {"search_env", "cpu_engine", "reward_fns"},
    "eval": {"search_env", "cpu_engine", "reward_fns", "patches"},
    "patches": {"search_env", "cpu_engine", "cpu_compat"},
    "launch": {"search_env", "search_demo", "reward_fns"},
    "study": {"eval", "launch", "search_env", "reward_fns"},
}
"""Per package, the other project packages it may import (docs/design.md §2, its last column)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO_ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to (a name inside a module resolves to that module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (anywhere in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    found.add(resolved)
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a module path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_project_imports_form_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["search_demo.warm_start"], "the graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_the_design_allows(package):
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.split(".")[0] == package
        for target in targets
        if target.split(".")[0] not in ALLOWED[package] | {package}
    )
    assert not wrong, wrong


def uncommented_local_imports(source: str) -> list[int]:
    """Lines of the function-local import statements of ``source`` whose first line has no ``#``
    comment (the reason it is not at module level)."""
    lines = source.splitlines()
    found: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and "#" not in lines[inner.lineno - 1]:
                    found.add(inner.lineno)
    return sorted(found)


def test_uncommented_local_imports_finds_them():
    source = "def f():\n    import json  # light\n    import os\n\n    def g():\n        from a import (\n            b,  # no\n        )\n"
    assert uncommented_local_imports(source) == [3, 6]


def test_function_local_imports_say_why():
    """A function-local import only where it avoids a heavy or optional dependency, with the reason
    as a comment on its first line (docs/design.md); everything else is imported at module level."""
    bare = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in _modules().values()
        for line in uncommented_local_imports(path.read_text(encoding="utf-8"))
    ]
    assert not bare, "function-local imports without a reason comment: " + ", ".join(bare)


def test_one_training_run_reads_in_the_launch_package():
    """``python -m launch run`` (launch/run.sh) -> launch.train -> the preflight's run setup, the resume
    check, the retriever it starts and watches, the shared probe (docs/design.md §2)."""
    graph = import_graph()
    assert {"launch.train", "launch.evaluate", "launch.prepare"} <= graph["launch.__main__"]
    assert {"launch.preflight", "launch.resume", "launch.retriever", "launch.progress"} <= graph[
        "launch.train"
    ]
    assert "search_env.retrieval.probe" in graph["launch.train"] & graph["launch.evaluate"]
    assert "search_env.retrieval.probe" in graph["eval.run.runner"] & graph["search_env.retrieval.process"]


def test_one_evaluation_reads_in_its_two_lifecycles():
    """eval/run/ produces results and imports nothing of eval/report/, which reads them through the
    results schema (eval/schema.py); every eval module but the schema, the shared statistics and the
    dispatcher sits in one of the two;
    the launcher and the runner share one setup of the retriever and one tool writer."""
    graph = import_graph()
    eval_modules = {m for m in graph if m.split(".")[0] == "eval"}
    loose = sorted(m for m in eval_modules if not m.startswith(("eval.run", "eval.report")))
    assert loose == ["eval", "eval.__main__", "eval.schema", "eval.stats"], loose
    wrong = sorted(
        f"{m} imports {t}"
        for m in eval_modules
        if m.startswith("eval.run")
        for t in graph[m]
        if t.startswith("eval.report")
    )
    assert not wrong, wrong
    # the results schema is a floor below both halves: the report reads results through it, and
    # imports of eval/run/ only the plan's arithmetic and the suite reader (``python -m eval plan``)
    assert not {t for t in graph["eval.schema"] if t.startswith(("eval.run", "eval.report"))}
    producer = sorted(
        {t for m in eval_modules if m.startswith("eval.report") for t in graph[m] if t.startswith("eval.run")}
    )
    assert producer == ["eval.run", "eval.run.sequential", "eval.run.suite"], producer
    assert "launch.recipe" in graph["launch.evaluate"] & graph["launch.preflight"]
    assert "launch.retriever" in graph["launch.evaluate"] & graph["launch.train"]
    assert "search_env.verl_glue" in graph["launch.preflight"] & graph["eval.run.rollout"]


def test_diagnostics_stand_apart_from_the_launchers():
    """launch/doctor/ holds diagnostics, not launchers: a launcher uses only its CUDA diagnosis, and
    the install check imports nothing of ours (a bare python3 runs it before anything is installed)."""
    graph = import_graph()
    into = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m.split(".")[0] == "launch" and not m.startswith("launch.doctor")
        for t in targets
        if t.startswith("launch.doctor") and t != "launch.doctor.cuda"
    )
    assert not into, into
    assert graph["launch.doctor.install_verdict"] == set()
    assert "search_env.__main__" not in graph, "the retrieval CLI is search_env.retrieval's"


EMBEDDED_PYTHON = re.compile(r"(PYTHON|python3?)\"?\s+-\s*<<|<<\s*'?PY'?|(PYTHON|python3?)\"?\s+-c\s")


def test_launch_scripts_embed_no_python():
    """The shell scripts of launch/ choose an interpreter and call Python entry points; the one
    ``-c`` left is _common.sh's probe whether an interpreter has verl."""
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted((REPO_ROOT / "launch").glob("*.sh"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if EMBEDDED_PYTHON.search(line) and 'find_spec("verl")' not in line
    ]
    assert not found, found


TEST_FOLDERS = {pkg for pkg in PACKAGES if pkg != "cpu_compat"} | {"retrieval", "study", "e2e"}
"""tests/ mirrors the packages (``search_env.retrieval``: tests/retrieval/, ``study``: tests/study/);
tests/e2e/ holds the whole runs (the CPU demo, vLLM, faults, a killed run)."""
REPOSITORY_WIDE = {"test_import_graph.py", "test_committed_results.py", "test_heavy_slot.py"}
"""The test files at tests/ top level, beside the shared helpers (conftest, study_reference,
heavy_slot) and fixtures/: checks of the whole repository."""
STARTS_A_DEMO_RUN = re.compile(r"\b(demo_cmd|start_demo|demo_eval)\(")
E2E_MARK = re.compile(r"\bpytest\.mark\.e2e\b")


def test_tests_mirror_the_packages_and_whole_runs_live_in_e2e():
    tests = REPO_ROOT / "tests"
    files = sorted(p for p in tests.rglob("test_*.py") if "fixtures" not in p.relative_to(tests).parts)
    folders = {p.parent.relative_to(tests).as_posix() for p in files} - {"."}
    assert folders <= TEST_FOLDERS, f"a test folder that mirrors no package: {sorted(folders - TEST_FOLDERS)}"
    for folder in TEST_FOLDERS - {"e2e"}:
        package = REPO_ROOT / ("search_env/retrieval" if folder == "retrieval" else folder)
        assert (package / "__init__.py").is_file(), f"tests/{folder}/ mirrors no package"
    assert {p.name for p in files if p.parent == tests} <= REPOSITORY_WIDE
    names = [p.name for p in files]
    # pytest imports a test module by its file name (no __init__.py under tests/): one file per name
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert not list(tests.rglob("__init__.py")), "tests/ is no package: helpers are found via pythonpath"
    # the folder is the one way a test is e2e (tests/conftest.py marks tests/e2e/): no file marks it,
    # and every whole run lives there
    texts = {p.relative_to(tests).as_posix(): p.read_text(encoding="utf-8") for p in files}
    marked = sorted(name for name, text in texts.items() if E2E_MARK.search(text))
    assert not marked, f"only the folder tests/e2e/ makes a test e2e; move these there, unmarked: {marked}"
    outside = {name: text for name, text in texts.items() if not name.startswith("e2e/")}
    runs = sorted(name for name, text in outside.items() if STARTS_A_DEMO_RUN.search(text))
    assert not runs, f"these start the CPU demo outside tests/e2e/ (move them there): {runs}"
    gone = [name for name in FILES_FIRST + FILES_LAST if not (tests / name).is_file()]
    assert not gone, f"tests/conftest.py FILES_FIRST/FILES_LAST name files that do not exist: {gone}"
    # a file that holds every heavy-run slot belongs to the exclusive group (one worker, in turn)
    every_slot = sorted(
        name
        for name, text in texts.items()
        if name.startswith("e2e/") and re.search(r"acquire_all|--all\"|exclusive=True", text)
    )
    assert every_slot == sorted(EXCLUSIVE_FILES), f"tests/conftest.py EXCLUSIVE_FILES is not {every_slot}"
