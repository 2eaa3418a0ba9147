"""The package's shape, read from its AST: no function in ``qwz/`` longer than 60 lines, no
file longer than 600 and no class longer than 150 unless it says why, no import cycle, and
dependencies that point down only (DESIGN.md, "Layout").

The import graph has one edge per ``import``/``from ... import`` anywhere in a module,
function-level ones (a lazy import is still a dependency) and those under
``if TYPE_CHECKING:`` included (what an annotation names, its reader must read)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[3] / "qwz"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 150
SAYS_WHY = "longer than {limit} lines because"
"""What a file's docstring (a class's, for a class) says where it must be longer than its
limit, followed by the reason."""

LAYERS = {
    "core": 0,
    "integrations": 1,
    "qualify.base": 2,
    "qualify.evidence": 3,
    "qualify.run": 4,
    "qualify.review": 4,
    "qualify.request": 5,
    "qualify.matrix": 6,
    "qualify.bisect": 6,
    "qualify.pr_review": 7,
    "qualify": 8,
}
"""Each layer is a folder of ``qwz/qualify/`` (a module's layer is its folder's; the modules at
``qualify/``'s top -- the CLI -- are the top layer, ``qualify``). A module may import its own
folder and any folder of a lower layer: run and review are siblings (neither imports the
other), the request (the resolved ``run`` request and its preflight) reads the run's
workloads and the evidence's rules, the matrix runs ``run`` cells (it is handed the CLI's
parser, never imports it), bisect drives whole runs (as subprocesses) and judges their
records, matrix and bisect are siblings, the review of a pull request runs two ``run``s as a
matrix runs its cells and checks out commits as bisect does (it reuses both), the CLI sits on
top."""


def _modules(root: pathlib.Path = PACKAGE_DIR) -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: pathlib.Path) -> set[str]:
    """Every dotted name `module` imports: ``from a import b`` imports ``a.b`` (a module, or a
    name inside the module ``a``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:  # ``if TYPE_CHECKING:`` imports are imports too
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph(root: pathlib.Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module -> the qwz modules it imports (a name inside a module counts as the module)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in _imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def group_of(module: str, root: pathlib.Path = PACKAGE_DIR) -> str:
    """The layer folder `module` lives in: ``qualify.<folder>`` for a module in a folder of
    ``qwz/qualify/``, ``qualify`` for one at its top, ``integrations`` or ``core``."""
    parts = module.split(".")
    if parts[1:2] == ["integrations"]:
        return "integrations"
    if parts[1:2] != ["qualify"]:
        return "core"
    if len(parts) > 3 or (len(parts) == 3 and (root / "qualify" / parts[2]).is_dir()):
        return f"qualify.{parts[2]}"
    return "qualify"


def long_functions(root: pathlib.Path = PACKAGE_DIR) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function longer than MAX_FUNCTION_LINES, counted
    from its ``def`` line to its last line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    where = path.relative_to(root.parent)
                    found.append((lines, f"{where}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def _in_qualify(item: str) -> bool:
    return item.startswith("qwz/qualify/") or item.startswith("qwz.qualify")


def test_no_function_in_qualify_is_longer_than_60_lines():
    offenders = [item for item in long_functions() if _in_qualify(item[1])]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"


def test_no_function_in_qwz_is_longer_than_60_lines():
    offenders = long_functions()
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"


def test_no_import_cycle_in_qualify():
    found = [cycle for cycle in cycles(import_graph()) if any(map(_in_qualify, cycle))]
    assert not found, f"import cycles: {found}"


def test_no_import_cycle_in_qwz():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_imports_point_down_only():
    graph = import_graph()
    upward = [
        f"{module} ({group_of(module)}) imports {target} ({group_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if group_of(module) != group_of(target)
        and LAYERS[group_of(module)] <= LAYERS[group_of(target)]
    ]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_every_qualify_module_has_a_layer():
    unknown = {group_of(module) for module in _modules()} - set(LAYERS)
    assert not unknown, f"modules outside the layers: {unknown}"


def _write(root: pathlib.Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_graph_sees_lazy_and_relative_imports_and_finds_their_cycle(tmp_path):
    """The detector itself: a cycle through a function-level relative import is found, and an
    ``if TYPE_CHECKING:`` import is an edge like any other (a type-only arrow up is an arrow
    up: the module's reader needs the other to read it)."""
    root = tmp_path / "qwz"
    _write(root, "__init__.py", "")
    _write(root, "a.py", "def f():\n    from .b import g\n")
    _write(root, "b.py", "from qwz import a\n")
    _write(root, "c.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import qwz.a\n")
    graph = import_graph(root)
    assert cycles(graph) == [["qwz.a", "qwz.b"]]
    assert graph["qwz.c"] == {"qwz.a"}


def test_the_length_count_finds_a_long_function(tmp_path):
    body = "".join(f"    x{index} = {index}\n" for index in range(MAX_FUNCTION_LINES))
    _write(tmp_path / "qwz", "long.py", "def too_long():\n" + body + "\n\ndef short():\n    pass\n")
    found = long_functions(tmp_path / "qwz")
    assert found == [(MAX_FUNCTION_LINES + 1, "qwz/long.py:1 too_long")]


def imported_by(graph: dict[str, set[str]], start: str) -> set[str]:
    """`start` and every module it imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def top_level_tools(root: pathlib.Path = PACKAGE_DIR) -> set[str]:
    """The modules directly in ``qwz/`` (packages excluded) that the engine does not import."""
    top_level = {
        module
        for module, path in _modules(root).items()
        if path.parent == root and path.name != "__init__.py"
    }
    return top_level - imported_by(import_graph(root), "qwz.engine")


def test_qwz_top_level_is_the_engine():
    """DESIGN.md, "Layout": ``qwz/``'s top level holds the engine only -- every module there is
    one the engine imports (the harness's tooling lives under ``qwz/qualify/``, the wire
    probe beside the integrations that use it)."""
    assert top_level_tools() == set(), "not imported by the engine: tooling, move it"


def test_the_top_level_check_catches_a_tool_there(tmp_path):
    """The check above can fail: a module the engine never imports is found."""
    for path in PACKAGE_DIR.rglob("*.py"):
        target = tmp_path / "qwz" / path.relative_to(PACKAGE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (tmp_path / "qwz" / "probe_tool.py").write_text("import torch\n")
    assert top_level_tools(tmp_path / "qwz") == {"qwz.probe_tool"}


FRONT_DOOR = {"qwz.qualify", "qwz.qualify.__main__", "qwz.qualify.cli", "qwz.qualify.cli_parser"}
"""The modules at ``qualify/``'s top: the commands' parser and handlers; every other module of
the harness lives in the folder of its layer."""


def test_qualify_top_holds_the_cli_only():
    top = {module for module in _modules() if group_of(module) == "qualify"}
    assert top <= FRONT_DOOR, f"put these in the folder of their layer: {top - FRONT_DOOR}"


def oversized(root: pathlib.Path = PACKAGE_DIR) -> list[str]:
    """Every file longer than MAX_FILE_LINES and every class longer than MAX_CLASS_LINES,
    with its lines, and whether its docstring says why (``SAYS_WHY``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        where = path.relative_to(root.parent)
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            says = SAYS_WHY.format(limit=MAX_FILE_LINES) in (ast.get_docstring(tree) or "")
            found.append(f"{where}: {lines} lines" + ("" if says else ", not saying why"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    says = SAYS_WHY.format(limit=MAX_CLASS_LINES) in (ast.get_docstring(node) or "")
                    found.append(
                        f"{where}:{node.lineno} class {node.name}: {lines} lines"
                        + ("" if says else ", not saying why")
                    )
    return found


def test_files_and_classes_over_their_limits_say_why():
    """Over 600 lines a file, over 150 a class, must say why in its docstring; the list is
    printed so a reader sees what is long today."""
    found = oversized()
    print("\n".join(found))
    unexplained = [item for item in found if item.endswith("not saying why")]
    assert not unexplained, "too long, and not saying why:\n" + "\n".join(unexplained)


def test_the_size_check_finds_a_long_class_and_file_that_do_not_say_why(tmp_path):
    long_class = "class Long:\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    padding = "".join(f"y{i} = {i}\n" for i in range(MAX_FILE_LINES))
    _write(tmp_path / "qwz", "long.py", '"""A module."""\n' + long_class + padding)
    says = SAYS_WHY.format(limit=MAX_CLASS_LINES)
    _write(tmp_path / "qwz", "said.py", f'class Said:\n    """It is {says} it must be."""\n')
    (tmp_path / "qwz" / "said.py").write_text(
        (tmp_path / "qwz" / "said.py").read_text()
        + "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    )
    assert oversized(tmp_path / "qwz") == [
        f"qwz/long.py: {MAX_CLASS_LINES + MAX_FILE_LINES + 2} lines, not saying why",
        f"qwz/long.py:2 class Long: {MAX_CLASS_LINES + 1} lines, not saying why",
        f"qwz/said.py:1 class Said: {MAX_CLASS_LINES + 2} lines",
    ]


def test_no_two_harness_modules_share_a_file_name():
    """One name per idea: a file name says which module it is anywhere in ``qualify/``."""
    seen: dict[str, list[str]] = {}
    for path in sorted((PACKAGE_DIR / "qualify").rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE_DIR.parent)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"file names used twice: {shared}"


def test_the_unit_tests_mirror_the_package():
    """tests/unit/qualify/ has a folder for a folder of ``qualify/`` only (its tests beside
    the layer they test)."""
    tests = pathlib.Path(__file__).resolve().parent
    package = PACKAGE_DIR / "qualify"
    folders = {
        path.relative_to(tests)
        for path in tests.rglob("*")
        if path.is_dir() and path.name not in ("golden", "__pycache__")
    }
    assert {folder for folder in folders if not (package / folder).is_dir()} == set()
