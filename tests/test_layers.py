"""The package's layering as tests, so CI keeps it (issue 31): imports point down, never in a circle, never hidden.

Every module under ``src/entrenar`` is read with :mod:`ast` (nothing is imported). An ``import`` under
``if TYPE_CHECKING:`` is a type annotation's and counts for none of the rules. The packages, bottom to top
(docs/ARCHITECTURE.md, "Layers"):

    0  errors, device, io           what everything uses: the error kinds, device/dtype resolution, file helpers
    1  data                         records, tokenizers, batches (no recipe, no model)
    2  config                       the recipe (it checks SQLite queries through data)
    3  models                       the plain decoder, its files, surgery, losses, random init
    4  adapters < quant < kernels   wrappers applied from outside; kernels fuse what the other two define
    5  distributed                  processes, parallel wrappers, sharded state
    6  evaluation, generation       held-out scores, sampling
    7  loading, quickstart          ``entrenar.load`` and run folders; the bundled quickstart task
    8  tasks < train                what a batch means; the loop that runs a task
    9  export, merge, experiments   leaves: nothing in the core imports them
    10 cli, __main__                parse, call, print

A package may import its own line and the lines below it; where a line shows ``<``, only leftwards. The front
door ``entrenar/__init__.py`` imports only ``entrenar.errors`` when it loads; its lazy ``__getattr__`` reaches
``entrenar.loading``.

The rules:

* :func:`test_imports_point_down`: no import of an entrenar module (at module level or inside a function) goes up.
* :func:`test_no_import_cycles`: no cycle among modules, counting module-level imports (and the package
  ``__init__`` each one runs).
* :func:`test_no_imports_inside_functions`: an import inside a function hides a cycle or a layer breach from the
  reader, so there is none, save an optional or slow third-party package (``OPTIONAL_OR_SLOW``), the CLI's and the
  front door's (start-up time), and the few entries of ``FUNCTION_IMPORTS`` with their reasons.

``PENDING_UPWARD`` and ``PENDING_IN_FUNCTIONS`` list breaches in modules other branches of issue 31 are rewriting;
each entry names its fix and goes with it (a test fails once an entry matches no breach, so the lists only shrink).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "entrenar"

# Bottom to top; packages in one tuple share a rank and may import one another.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "device", "io"),
    ("data",),
    ("config",),
    ("models",),
    ("adapters",),  # line 4: adapters < quant < kernels
    ("quant",),
    ("kernels",),
    ("distributed",),
    ("evaluation", "generation"),
    ("loading",),
    ("tasks",),
    ("quickstart",),  # the quickstart is a causal-LM task with its own files and accuracy
    ("train",),
    ("export", "merge", "experiments"),
    ("cli", "__main__"),
)

# Upward imports the order allows, with their reasons: (importing module or package, imported module).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("entrenar.tasks", "entrenar.train.metrics"):
        "a task reads back the metrics the run wrote (metrics.jsonl's reader lives beside its writer)",
}

# Third-party packages (or their submodules) a function may import: optional extras, platform-dependent parts
# or slow imports only some paths need.
OPTIONAL_OR_SLOW: dict[str, str] = {
    "triton": "CUDA only; imported when a kernel first runs",
    "matplotlib": "optional extra `plot`",
    "pyarrow": "optional extra `parquet`",
    "torch.utils.tensorboard": "optional extra `tensorboard`",
    "mlflow": "optional extra `mlflow` (mlflow-skinny)",
    "wandb": "optional extra `wandb`",
    "llama_cpp": "optional extra `llama-cpp` (llama-cpp-python: compiles llama.cpp)",
    "torch.distributed": "absent from some torch builds; its launcher, FSDP, DTensor and DCP take seconds to import",
    "torch.nn.parallel": "DDP: only a multi-process run needs it",
    "gguf": "about 0.1 s to import (numpy tables); only GGUF files need it",
    "resource": "POSIX only",
}

# Imports of entrenar inside functions, each with its reason: (importing module or package, imported module or
# package).
_MODEL_STACK = ("start-up time: `entrenar merge` reads and writes tensors without the model stack, whose import "
                "takes about 4 s (models/padding_free imports torch.nn.attention.varlen, which imports torch._dynamo); "
                "only GGUF inputs and outputs and LoRA adapters need it")
FUNCTION_IMPORTS: dict[tuple[str, str], str] = {
    ("entrenar.merge", "entrenar.models"): _MODEL_STACK,
    ("entrenar.merge", "entrenar.adapters"): _MODEL_STACK,
    ("entrenar.merge", "entrenar.loading"): _MODEL_STACK,
    ("entrenar.merge", "entrenar.export"): _MODEL_STACK,
    ("entrenar.device", "torch"): "start-up time: the CLI reads DTYPES to build --help; torch takes seconds to import",
}

# Imports of entrenar inside functions are the CLI's way to stay fast: `entrenar --help` imports no torch.
START_UP_TIME = ("entrenar", "entrenar.cli")

# Breaches in modules that other branches of issue 31 are rewriting, each with its fix; remove an entry with its fix.
_SAVE_MODEL = "write the model with entrenar.models.saving.save_model_folder (export.save_merged is export's)"
PENDING_UPWARD: dict[tuple[str, str], str] = {}
_REWRITTEN = "imports move to the top of the module in the rewrite"
PENDING_IN_FUNCTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, dotted
    target: str  # the imported module (an attribute's import counts as its module's)
    line: int
    in_function: bool
    where: str  # path:line, for messages

    @property
    def top_level(self) -> str:
        return self.target.split(".")[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The modules an import statement loads, by dotted name (``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    found = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        if sub in modules():
            found.append(sub)
        elif module == ROOT and alias.name in ("load", "read_model_config"):  # the front door's lazy names
            found.append("entrenar.loading")
        else:
            found.append(module)
    return found


@cache
def imports() -> tuple[Import, ...]:
    """Every import statement under src/entrenar outside ``if TYPE_CHECKING:`` blocks."""
    found: list[Import] = []
    for name, path in modules().items():
        is_package = path.name == "__init__.py"
        where = path.relative_to(SRC.parent)

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for other in child.orelse:
                        visit_one(other, in_function)
                    continue
                visit_one(child, in_function)

        def visit_one(node: ast.AST, in_function: bool) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, is_package):  # noqa: B023 (called before the loop moves on)
                    found.append(Import(name, target, node.lineno, in_function, f"{where}:{node.lineno}"))  # noqa: B023
            visit(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return tuple(dict.fromkeys(found))  # one entry for `from m import a, b`


def _ours(imp: Import) -> bool:
    return imp.top_level == ROOT


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rank(module: str) -> int:
    """The layer of an entrenar module; the package root (``__version__``, ``EntrenarError``) sits at the bottom."""
    if module == ROOT:
        return 0
    package = module.split(".")[1]
    for i, line in enumerate(LAYERS):
        if package in line:
            return i
    raise AssertionError(f"{module}: its package is in no layer of LAYERS; add it where it belongs")


def _listed(imp: Import, table: dict[tuple[str, str], str]) -> tuple[str, str] | None:
    for importer, target in table:
        if _within(imp.importer, importer) and _within(imp.target, target):
            return importer, target
    return None


def upward_imports() -> list[Import]:
    """Imports of entrenar that go up the order and are not allowed by ``ALLOWED_UPWARD``."""
    found = []
    for imp in imports():
        if not _ours(imp) or _listed(imp, ALLOWED_UPWARD):
            continue
        if imp.importer == ROOT:
            if not imp.in_function and imp.target != "entrenar.errors":
                found.append(imp)
            continue
        if rank(imp.target) > rank(imp.importer):
            found.append(imp)
    return found


def function_imports() -> list[Import]:
    """Imports inside functions that no rule above allows."""
    found = []
    for imp in imports():
        if not imp.in_function:
            continue
        if _ours(imp):
            if imp.importer in START_UP_TIME[:1] or _within(imp.importer, START_UP_TIME[1]):
                continue
            if _listed(imp, FUNCTION_IMPORTS):
                continue
        elif any(_within(imp.target, package) for package in OPTIONAL_OR_SLOW) or _listed(imp, FUNCTION_IMPORTS):
            continue
        found.append(imp)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules its module-level imports run: the target and each package ``__init__`` above it that
    the importer is not itself inside (those are already running)."""
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for imp in imports():
        if imp.in_function or not _ours(imp) or imp.target not in modules():
            continue
        parts = imp.target.split(".")
        for end in range(2, len(parts) + 1):
            target = ".".join(parts[:end])
            if target != imp.importer and not _within(imp.importer, target) and target in modules():
                graph[imp.importer].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _report(found: list[Import]) -> str:
    return "\n".join(f"  {imp.where}: {imp.importer} imports {imp.target}" for imp in found)


def test_every_package_has_a_layer() -> None:
    for name in modules():
        rank(name)


def test_imports_point_down() -> None:
    found = [imp for imp in upward_imports() if not _listed(imp, PENDING_UPWARD)]
    assert not found, "imports going up the layers (tests/test_layers.py's docstring has the order):\n" + _report(found)


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles among module-level imports:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_imports_inside_functions() -> None:
    found = [imp for imp in function_imports() if not _listed(imp, PENDING_IN_FUNCTIONS)]
    assert not found, ("imports inside functions (move them to the top of the module, or list them in "
                       "tests/test_layers.py with their reason):\n" + _report(found))


def test_listed_exceptions_are_still_needed() -> None:
    """An entry of the allow-lists that matches no import, or of the PENDING lists that matches no breach, is
    stale: remove it."""
    for table in (FUNCTION_IMPORTS, ALLOWED_UPWARD):
        for importer, target in table:
            assert any(_within(i.importer, importer) and _within(i.target, target) for i in imports()), (
                f"({importer!r}, {target!r}) matches no import any more: remove it from tests/test_layers.py")
    for table, breaches in ((PENDING_UPWARD, upward_imports()), (PENDING_IN_FUNCTIONS, function_imports())):
        for importer, target in table:
            assert any(_within(i.importer, importer) and _within(i.target, target) for i in breaches), (
                f"({importer!r}, {target!r}) is fixed: remove its entry from tests/test_layers.py")


def test_rules_catch_breaches() -> None:
    """The checks themselves: an upward import, a cycle and a hidden import are each found."""
    assert rank("entrenar.train.loop") > rank("entrenar.tasks.base") > rank("entrenar.models.hf")
    assert rank("entrenar.kernels.rope") > rank("entrenar.quant.int") > rank("entrenar.adapters.lora")
    assert rank("entrenar.errors") == rank("entrenar.io.atomic") == rank(ROOT)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    from ..models import hf\n")
    node = tree.body[0].body[0]
    assert _targets(node, "entrenar.quant.checkpoint", False) == ["entrenar.models.hf"]


def test_cli_help_imports_no_torch() -> None:
    """The reason the CLI imports the library inside its commands: ``entrenar --help`` stays instant."""
    code = ("import sys; from entrenar.cli.main import build_parser; build_parser(); "
            "sys.exit(sorted(m for m in ('torch', 'numpy') if m in sys.modules) or None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)})
    assert result.returncode == 0, result.stderr or result.stdout


@pytest.mark.parametrize("package", sorted({name.split(".")[1] for name in modules() if "." in name}))
def test_package_is_layered(package: str) -> None:
    rank(f"{ROOT}.{package}")
