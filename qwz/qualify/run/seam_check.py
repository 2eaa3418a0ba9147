"""The seam's preflight: can the harness read the subject DeepSpeed's ZeRO-1/2 optimizer?

[Note: seam preflight]
Before any rank starts, ``run`` with a DeepSpeed subject reads the source of the DeepSpeed
the ranks will import (``--deepspeed-src PATH``'s ``deepspeed/``, else the installed
package, located without importing it) and checks that ``DeepSpeedZeroOptimizer`` has
what the seam reads ([Note: reading DeepSpeed by capability] in
qwz/integrations/deepspeed/structure.py) -- for ``deepspeed`` also what qwz's takeover
replaces and reads ([Note: what is replaced] in qwz/integrations/deepspeed/takeover.py).
A DeepSpeed that lacks any of it is refused (exit 2) naming what it lacks and its version
and commit, instead of every arm crashing inside the harness.

It parses the source (``ast``) rather than importing DeepSpeed: an import takes seconds to
tens of seconds on a loaded CPU, and this runs before every DeepSpeed run. An attribute
counts as present when ``DeepSpeedZeroOptimizer`` or a base class it imports from
DeepSpeed assigns ``self.<name>`` anywhere in its methods, or defines ``<name>``. What a
static reading cannot see (an attribute set through ``setattr``) the ranks still meet:
the seam raises SeamError there and the run ends HARNESS-ERROR ([Note: harness errors]),
never the subject's FAIL. The parameter offsets need no attribute: without
``round_robin_bit16_offsets`` the seam reads them from the parameters' views.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from typing import NamedTuple

from qwz.integrations.deepspeed import structure
from qwz.integrations.deepspeed.config import SUPPORTED_DEEPSPEED, version_tuple

OPTIMIZER_FILE = pathlib.Path("runtime", "zero", "stage_1_and_2.py")
OPTIMIZER_CLASS = "DeepSpeedZeroOptimizer"
SEAM_NEEDS = (*structure.NEEDED, "optimizer")
"""What the seam reads for every DeepSpeed subject (``optimizer``: the torch optimizer that
steps the masters, the seam's ``shard_optimizer``)."""
TAKEOVER_NEEDS = (
    "allgather_bucket_size",
    "cpu_offload",
    "overflow",
    "step",
    "update_lp_params",
    "_restore_from_bit16_weights",
    "refresh_fp32_params",
)
"""What qwz's takeover (``--subject deepspeed``'s candidates) also reads or replaces."""
GATHER_FUNCTION = "all_gather_dp_groups"
"""The module-level name in stage_1_and_2.py the takeover redirects while ``step`` runs."""
BASE_DEPTH = 4
"""How many base classes deep the attributes are looked for."""


class Capabilities(NamedTuple):
    """What a DeepSpeed source's ``DeepSpeedZeroOptimizer`` has, read statically."""

    names: frozenset[str]
    """Attributes it (or a DeepSpeed base class) assigns on ``self``, and its methods."""
    gather_function_bound: bool
    """stage_1_and_2.py binds ``all_gather_dp_groups`` and the class calls it."""


def package_location(source: str | pathlib.Path | None) -> pathlib.Path | None:
    """The ``deepspeed/`` directory the ranks will import, found without importing it."""
    if source is not None:
        return pathlib.Path(source).resolve() / "deepspeed"
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    return pathlib.Path(spec.origin).resolve().parent


def source_version(package: pathlib.Path) -> str:
    """DeepSpeed's version read from its files: the install-time ``git_version_info_installed.py``
    when there is one, else the checkout's ``version.txt`` ([Note: a checkout's real version])."""
    installed = package / "git_version_info_installed.py"
    if installed.is_file():
        try:
            for node in ast.parse(installed.read_text(errors="replace")).body:
                if (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "version" for t in node.targets)
                    and isinstance(node.value, ast.Constant)
                ):
                    return str(node.value.value).strip()
        except SyntaxError:
            pass
    return structure.real_version(package, "unknown")


def describe(package: pathlib.Path) -> str:
    """ "DeepSpeed 0.19.6 at <commit> from <path>", read without importing it."""
    commit = structure.package_commit(package)
    where = f"at {commit}" if commit else "(not a git checkout)"
    return f"DeepSpeed {source_version(package)} {where} from {package}"


def _module_file(package: pathlib.Path, module: str) -> pathlib.Path | None:
    """The file of the DeepSpeed module `module` ("deepspeed.runtime.x"), None elsewhere."""
    parts = module.split(".")
    if parts[0] != package.name:
        return None
    base = package.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _class_names(node: ast.ClassDef) -> set[str]:
    """Methods of the class and attributes its methods assign on ``self``."""
    names = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Attribute)
            and isinstance(inner.ctx, ast.Store)
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "self"
        ):
            names.add(inner.attr)
    return names


def _find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next(
        (node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None
    )


def _imported_from(tree: ast.Module, name: str) -> str | None:
    """The module `name` is imported from at the top of `tree` (``from M import name``)."""
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and any((alias.asname or alias.name) == name for alias in node.names)
        ):
            return node.module
    return None


def _names_with_bases(
    package: pathlib.Path, tree: ast.Module, node: ast.ClassDef, depth: int
) -> set[str]:
    names = _class_names(node)
    if depth == 0:
        return names
    for base in node.bases:
        if not isinstance(base, ast.Name):
            continue
        found, base_tree = _find_class(tree, base.id), tree
        if found is None:
            module = _imported_from(tree, base.id)
            path = _module_file(package, module) if module else None
            if path is None:
                continue
            try:
                base_tree = ast.parse(path.read_text(errors="replace"))
            except SyntaxError:
                continue
            found = _find_class(base_tree, base.id)
        if found is not None:
            names |= _names_with_bases(package, base_tree, found, depth - 1)
    return names


def capabilities(package: pathlib.Path) -> Capabilities | str:
    """What `package`'s ``DeepSpeedZeroOptimizer`` has, or why it cannot be read."""
    path = package / OPTIMIZER_FILE
    try:
        tree = ast.parse(path.read_text(errors="replace"), filename=str(path))
    except OSError as error:
        return f"cannot read deepspeed/{OPTIMIZER_FILE}: {error.strerror or error}"
    except SyntaxError as error:
        return f"cannot parse deepspeed/{OPTIMIZER_FILE}: {error.msg} (line {error.lineno})"
    node = _find_class(tree, OPTIMIZER_CLASS)
    if node is None:
        return f"deepspeed/{OPTIMIZER_FILE} defines no class {OPTIMIZER_CLASS}"
    bound = _imported_from(tree, GATHER_FUNCTION) is not None or any(
        isinstance(item, ast.FunctionDef) and item.name == GATHER_FUNCTION for item in tree.body
    )
    called = any(
        isinstance(inner, ast.Call)
        and isinstance(inner.func, ast.Name)
        and inner.func.id == GATHER_FUNCTION
        for inner in ast.walk(node)
    )
    names = _names_with_bases(package, tree, node, BASE_DEPTH)
    return Capabilities(frozenset(names), bound and called)


def seam_problems(subject: str, source: str | pathlib.Path | None) -> list[str]:
    """Why the harness could not observe `subject` (``deepspeed`` or ``deepspeed-native``)
    with the DeepSpeed at `source` (None: the installed one); one line each, [] when it can."""
    package = package_location(source)
    flag = f"--subject {subject}"
    if package is None:
        return [
            f"{flag}: deepspeed is not installed (pip install .[deepspeed]) "
            "and there is no --deepspeed-src"
        ]
    found = capabilities(package)
    if isinstance(found, str):
        return [f"{flag}: the harness cannot read {describe(package)}: {found}"]
    needs = SEAM_NEEDS + (TAKEOVER_NEEDS if subject == "deepspeed" else ())
    missing = [name for name in needs if name not in found.names]
    problems = []
    if missing:
        problems.append(
            f"{flag}: {describe(package)} lacks {OPTIMIZER_CLASS}."
            + f", {OPTIMIZER_CLASS}.".join(missing)
            + ", which the harness's DeepSpeed seam"
            + (" and qwz's takeover read" if subject == "deepspeed" else " reads")
            + " (qwz/qualify/run/seam_check.py [Note: seam preflight])"
        )
    if subject == "deepspeed":
        low, high = SUPPORTED_DEEPSPEED
        if not low <= version_tuple(source_version(package)) < high:
            problems.append(
                f"{flag}: {describe(package)} is not a DeepSpeed qwz's takeover supports "
                f"(>= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}); "
                "--subject deepspeed-native judges any DeepSpeed"
            )
    if subject == "deepspeed" and not found.gather_function_bound:
        problems.append(
            f"{flag}: in {describe(package)}, {OPTIMIZER_CLASS} does not call a module-level "
            f"{GATHER_FUNCTION} of deepspeed/{OPTIMIZER_FILE}, the weight gather qwz's takeover "
            "replaces ([Note: what is replaced], qwz/integrations/deepspeed/takeover.py)"
        )
    return problems
