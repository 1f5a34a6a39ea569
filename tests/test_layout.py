"""The repository's shape (issue 28): the top level holds the design card's three Python files and
components/ the support modules, and the project's imports form layers without a cycle: model.py and
data.py at the bottom, components/ above them, train.py on top. Imports inside functions count: a lazy
import hides a cycle from Python's loader, not from a reader."""
import ast
import glob
import graphlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOTTOM = {"model", "data"}


def module_files() -> dict[str, str]:
    """Project module name ('train', 'components.checkpoints') -> its path: the top level's and components/'s .py
    files (tests/ and bench/ use the project, they are not part of its layers)."""
    files = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
    for p in glob.glob(os.path.join(ROOT, "components", "*.py")):
        name = os.path.basename(p)[:-3]
        files["components" if name == "__init__" else f"components.{name}"] = p
    return files


def project_imports(path: str, modules: set[str]) -> set[str]:
    """The project modules one file imports, anywhere in it (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from components import hf` names the module hf; `from components.checks import x` names checks;
            # `from . import hf` inside components/ is the first
            package = "components" if node.level and os.path.dirname(path).endswith("components") else ""
            module = ".".join(filter(None, [package, node.module])) if node.level else node.module
            names = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {name: project_imports(path, set(files)) for name, path in files.items()}
    for name in graph:
        graph[name].discard(name)
    return graph


def test_imports_inside_functions_count(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import os\n\n\ndef f():\n    import train as T\n    from components import plan\n")
    assert project_imports(str(lazy), {"train", "components.plan", "model"}) == {"train", "components.plan"}


def test_top_level_is_the_design_card():
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert top == ["data.py", "model.py", "train.py"], f"top-level Python files {top}: the rest goes into components/"
    held = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "components", "*.py")))
    assert set(held) >= {"checks.py", "checkpoints.py", "flags.py", "hf.py", "out_dir.py", "metrics.py", "offload.py",
                         "sample.py"}, held


def test_imports_have_no_cycle():
    graph = import_graph()
    assert {"model", "components.checkpoints"} <= graph["train"], graph["train"]  # the parse sees imports: an empty graph has no cycle
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle (imports inside functions count): {' -> '.join(e.args[1])}") from None


def test_layers_model_and_data_at_the_bottom_train_on_top():
    graph = import_graph()
    for name in BOTTOM:
        above = sorted(graph.get(name, set()) - BOTTOM)
        assert not above, f"{name}.py imports {above}: it sits at the bottom"
    for name, imports in graph.items():
        if name.startswith("components"):
            assert "train" not in imports, f"{name} imports train: only train.py sits above components/"
    assert not any("train" in imports for imports in graph.values()), "nothing imports train.py"


def test_the_readmes_table_of_layers_is_the_import_graph():
    """README.md, "Files": each line of the layers table imports only from the lines below it, and every project
    module is on one line: the table is checked against the imports, not typed from memory."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme[readme.index("\n    train.py "):].split("\n\n")[0]
    rows = [[w[:-3].replace("/", ".") for w in line.split() if w.endswith(".py")] for line in block.splitlines()]
    layer = {name: depth for depth, row in enumerate(rows) for name in row}
    graph = import_graph()
    assert set(layer) == set(graph) - {"components"}, sorted(set(graph) ^ set(layer))
    for name, imports in graph.items():
        for imported in imports - {"components"}:
            assert layer[imported] > layer[name], f"{name} imports {imported}, which the README's table puts above it"


def test_tools_sit_above_the_trainer():
    """tools/ (the planner's report, data preparation, the demo corpus, the plot, the sizes) may import train.py;
    the trainer never imports a tool, so what a run is (its import closure) holds none of them."""
    files = module_files()
    for name, path in files.items():
        imported = project_imports(path, {"tools"} | {f"tools.{t}" for t in tool_names()})
        assert not imported, f"{name} imports {sorted(imported)}: a tool sits above the trainer"
    assert tool_names(), "tools/ holds the tools"


def tool_names() -> list[str]:
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools", "*.py")))


def test_the_sizes_tool_counts_the_closure_the_import_graph_gives():
    """tools/sizes.py (README.md's sizes table) counts every module train.py reaches in the import graph."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sizes", os.path.join(ROOT, "tools", "sizes.py"))
    sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizes)
    graph, reached, todo = import_graph(), {"train"}, ["train"]
    while todo:
        for name in graph[todo.pop()] - reached:
            reached.add(name)
            todo.append(name)
    assert set(sizes.closure()) == reached, sorted(set(sizes.closure()) ^ reached)
