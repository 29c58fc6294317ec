"""The package's shape: layers, no import circles, module and class sizes, one home for
exceptions and span attribute keys (docs/design.md, "Layers").

Read from the sources with ``ast``; nothing is imported but the modules that
declare the vocabularies checked.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import obsckpt
from obsckpt import errors
from obsckpt.telemetry import attributes

PACKAGE = Path(obsckpt.__file__).parent

# Lower layers first. A module may import its own layer and the layers below it,
# never one above (imports inside functions included; TYPE_CHECKING blocks aside).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "disk",
        (
            "errors",
            "validators",
            "env",
            "store",
            # Public paths kept for modules that moved into store/ (aliases).
            "loading",
            "commit",
            "torchfile",
            "tree",
            "staging",
            "save_threads",
        ),
    ),
    (
        "state and telemetry",
        ("telemetry", "admission", "tickets", "tracker", "options"),
    ),
    ("monitor", ("monitor", "monitor_link")),
    ("save side", ("save_job", "slot_staging", "coordinator_targets", "coordinator", "resume")),
    ("weight sync", ("sync",)),
    ("integrations", ("integrations",)),
    (
        "applications",
        ("inspection", "inspection_s3", "assets", "demo", "cli", "verl", "trinity", "__main__", ""),
    ),
]
MAX_MODULE_LINES = 620
MAX_CLASS_LINES = 400  # besides docstrings
# Exceptions that stay where they are raised: control flow inside one module, never
# seen by a caller of obsckpt.
INTERNAL_EXCEPTIONS = {
    # rootlock: flock unsupported here, caught in the same module to run unlocked.
    "_NoLocks",
    # demo.signals: a stop signal during start-up; a KeyboardInterrupt by design, so
    # that code between the signal and the demo's handler unwinds as for Ctrl-C.
    "StartupStopped",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    for index, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                return index
    raise AssertionError(f"obsckpt.{module} has no layer: add it to LAYERS in {__file__}")


def _imports(module: str, path: Path) -> set[str]:
    """The obsckpt modules ``module`` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                    full = "obsckpt" + ("." + name if name else "")
                else:
                    full = child.module or ""
                for alias in child.names:
                    # "from obsckpt import layout" imports the module layout; a name
                    # that is not a module comes from the module ``full`` itself.
                    sub = f"{full}.{alias.name}"
                    out.add(sub if sub.removeprefix("obsckpt.") in MODULES else full)
            elif isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            visit(child)

    visit(tree)
    local = set()
    for name in out:
        if name == "obsckpt" or name.startswith("obsckpt."):
            inner = name.removeprefix("obsckpt").removeprefix(".")
            if inner in MODULES and inner != module:
                local.add(inner)
    return local


def _docstring_lines(cls: ast.ClassDef) -> int:
    """Lines of the docstrings in ``cls``: they document its job, they are not another one."""
    lines = 0
    for node in ast.walk(cls):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines += first.end_lineno - first.lineno + 1
    return lines


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


class TestLayers:
    """Lower layers never import higher ones, and no two modules import each other."""

    def test_every_module_has_a_layer(self):
        for module in MODULES:
            _layer(module)

    def test_no_import_climbs_a_layer(self):
        climbing = [
            f"obsckpt.{module} ({LAYERS[_layer(module)][0]}) imports obsckpt.{target} "
            f"({LAYERS[_layer(target)][0]})"
            for module, targets in sorted(GRAPH.items())
            for target in sorted(targets)
            if _layer(target) > _layer(module)
        ]
        assert not climbing, "\n".join(climbing)

    def test_no_import_circles(self):
        circles = []
        state: dict[str, int] = {}
        stack: list[str] = []

        def walk(module: str) -> None:
            state[module] = 1
            stack.append(module)
            for target in sorted(GRAPH[module]):
                if state.get(target) == 1:
                    circles.append(" -> ".join(stack[stack.index(target) :] + [target]))
                elif target not in state:
                    walk(target)
            stack.pop()
            state[module] = 2

        for module in sorted(GRAPH):
            if module not in state:
                walk(module)
        assert not circles, "\n".join(circles)


class TestSizes:
    """Each module does one job: a few hundred lines, no class past ~400 (docstrings aside)."""

    @pytest.mark.parametrize("module", sorted(MODULES))
    def test_module_and_class_sizes(self, module):
        source = MODULES[module].read_text(encoding="utf-8")
        lines = source.count("\n")
        assert lines <= MAX_MODULE_LINES, f"obsckpt.{module} has {lines} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                assert size <= MAX_CLASS_LINES, (
                    f"{module}.{node.name} has {size} lines besides its docstrings"
                )


class TestExceptions:
    """Every exception a caller can see is defined in obsckpt.errors, under ObsckptError."""

    def test_defined_in_errors_only(self):
        elsewhere = []
        for module, path in MODULES.items():
            if module == "errors":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ClassDef) or node.name in INTERNAL_EXCEPTIONS:
                    continue
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith(("Error", "Exception", "Interrupt")) for b in bases):
                    elsewhere.append(f"obsckpt.{module}.{node.name}")
        assert not elsewhere, f"define these in obsckpt/errors.py: {elsewhere}"

    def test_all_under_the_root_and_exported(self):
        classes = [
            cls
            for _name, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
        ]
        assert len(classes) == len(errors.__all__)
        for cls in classes:
            assert issubclass(cls, errors.ObsckptError), cls
            assert cls.__name__ in obsckpt.__all__, cls
            assert getattr(obsckpt, cls.__name__) is cls

    def test_each_refines_a_builtin(self):
        for name in errors.__all__:
            cls = getattr(errors, name)
            if cls is errors.ObsckptError:
                continue
            builtin = [b for b in cls.__mro__ if b.__module__ == "builtins"]
            assert builtin[0] is not Exception or cls is errors.CliError, (
                f"{name} refines no builtin exception"
            )


class TestSpanAttributes:
    """Span attribute keys are constants of obsckpt.telemetry.attributes, each declared."""

    def test_every_constant_is_declared(self):
        constants = {
            value
            for name, value in vars(attributes).items()
            if name.isupper() and isinstance(value, str)
        }
        assert constants == set(attributes.SPAN_ATTRIBUTES)

    def test_keys_are_never_written_as_strings(self):
        declared = set(attributes.SPAN_ATTRIBUTES)
        literal = []
        for module, path in MODULES.items():
            if module == "telemetry.attributes":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                keys: list[ast.expr] = []
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                    "set_attribute",
                    "set_attributes",
                ):
                    keys = node.args[:1]
                elif isinstance(node, ast.Dict):
                    keys = [k for k in node.keys if k is not None]
                for key in keys:
                    if isinstance(key, ast.Constant) and key.value in declared:
                        literal.append(f"obsckpt.{module}:{key.lineno}: {key.value!r}")
        assert not literal, "use obsckpt.telemetry.attributes' constants:\n" + "\n".join(literal)

    def test_every_key_used_is_declared(self):
        used = []
        for module, path in MODULES.items():
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("span_attr", "attributes")
                    and node.attr.isupper()
                ):
                    used.append((module, node.attr))
        assert used, "no span attribute found: the scan looks for the wrong name"
        for module, name in used:
            assert name in vars(attributes), f"obsckpt.{module} uses undeclared {name}"
