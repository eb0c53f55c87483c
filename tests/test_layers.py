"""The layout is the architecture: each folder of pipeline/ is a layer, and a
layer imports only the layers under it (docs/architecture.md)."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Bottom first: the runtime every process uses (and the user's error every layer raises), the stage
# contract, the pure scheduler, then the layers in the order data travels; the entry (pipeline/*.py) on top.
LAYERS = ["pipeline.runtime", "stages", "pipeline.scheduler", "pipeline.data", "pipeline.delivery",
          "pipeline.training", "pipeline.measure", "pipeline.orchestration", "pipeline.report", "pipeline"]
TOP_MODULES_AT_MOST = 7  # what a user calls (the commands, the Hydra callbacks, predict) and a run's wiring


def layer_of(module: str) -> str:
    return max((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), key=len)


def modules():
    for path in sorted([*REPO.glob("pipeline/**/*.py"), *REPO.glob("stages/*.py")]):
        yield ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"), path


def project_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        yield from (name for name in names if name.split(".")[0] in ("pipeline", "stages"))


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_layer_imports_only_the_layers_under_it(module, path):
    mine = LAYERS.index(layer_of(module))
    upward = [name for name in project_imports(path) if LAYERS.index(layer_of(name)) > mine]
    assert not upward, f"{module} ({layer_of(module)}) imports {upward}, a layer above it"


def test_the_scheduler_is_pure_logic():
    """No processes, devices, plots or files: the scheduler decides, its callers act (a chart drawn or a
    file written in pipeline/scheduler fails, and so does an import of the runtime's signals or files, or
    of a stage: of the project it takes only the user's error)."""
    for module, path in modules():
        if layer_of(module) == "pipeline.scheduler":
            others = {name for name in project_imports(path) if layer_of(name) != "pipeline.scheduler"}
            assert others <= {"pipeline.runtime.errors"}, (module, others)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    assert not {n.split(".")[0] for n in names} & {"dask", "distributed", "torch", "pathlib", "os",
                                                                   "shutil", "matplotlib"}, module
                if isinstance(node, ast.Call):
                    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    assert called not in {"open", "savefig", "write_text", "write_bytes", "mkdir"}, (module, called)


def test_few_modules_stay_at_the_top_and_every_layer_says_what_it_owns():
    top = [p.name for p in (REPO / "pipeline").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= TOP_MODULES_AT_MOST, top
    for layer in LAYERS[:-1]:
        init = REPO / layer.replace(".", "/") / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "may import" in doc.lower(), f"{init} must say what the layer owns and what it may import"
