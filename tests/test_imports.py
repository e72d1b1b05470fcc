"""The top-level files import each other one way: no module imports another that imports it back,
directly or through others, at the top or inside a function (a lazy import is still a cycle: it
works only while the modules happen to load in one order)."""
import ast
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_graph(root):
    """{module: {project modules it imports, anywhere in the file}} for root's top-level .py files."""
    modules = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(root, "*.py"))}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = imported & set(modules) - {name}
    return graph


def find_cycle(graph):
    """A list of modules that import in a circle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_among_top_level_files():
    graph = import_graph(ROOT)
    assert {"train", "eval", "report", "checkpoint", "downstream", "hf_export", "prepare_data", "fileio",
            "configurator"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    # The ground floor (the README: each imports nothing of the project), and the file users copy alone.
    for module in ("fileio", "configurator", "init"):
        assert not graph[module], f"{module}.py imports {', '.join(sorted(graph[module]))}"
    for reader in ("downstream", "hf_export", "checkpoint"):  # checkpoint readers stand below train.py
        assert "train" not in graph[reader], f"{reader}.py imports train.py"


# The core a run needs, and the study's tools and the data ingester, which it must not load: a fork
# that keeps the core alone still trains, evaluates its checkpoints' data and resumes.
CORE = ("model", "analysis", "init", "data", "train", "checkpoint", "configurator", "fileio")
TOOLS = ("eval", "report", "sweep", "launch", "bench", "quickstart", "gpu_check", "prepare_data", "downstream")
ALLOWED = {"train": {"downstream"}}  # the one tool train.py may use (its benchmarks)


def import_chain(graph, start, target):
    """The modules from `start` to `target` along imports (breadth-first: a shortest chain), or None."""
    parents, todo = {start: None}, [start]
    while todo:
        node = todo.pop(0)
        if node == target:
            chain = []
            while node is not None:
                chain.append(node)
                node = parents[node]
            return chain[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in parents:
                parents[nxt] = node
                todo.append(nxt)
    return None


def test_the_core_never_loads_the_tools_or_the_ingester():
    graph = import_graph(ROOT)
    assert set(CORE) <= set(graph)
    for module in CORE:
        for tool in TOOLS:
            if tool in ALLOWED.get(module, ()):
                continue
            chain = import_chain(graph, module, tool)  # what an allowed tool imports is checked too
            assert chain is None, " imports ".join(chain)
    # data.py is what every reader of a data folder needs, and only that: of the project, fileio alone
    assert graph["data"] <= {"fileio"}, f"data.py imports {', '.join(sorted(graph['data']))}"
    # analysis.py measures a model for train.py and the tools alike: of the project, model alone
    assert graph["analysis"] <= {"model"}, f"analysis.py imports {', '.join(sorted(graph['analysis']))}"
    # report.py reads result files for eval.py, sweep.py and results/*.py: of the project, the core alone
    assert graph["report"] <= set(CORE), f"report.py imports {', '.join(sorted(graph['report'] - set(CORE)))}"


def test_reading_data_does_not_load_the_ingester_packages():
    """`datasets` and the hub client (seconds to import) are prepare_data.py's alone."""
    heavy = ("datasets", "huggingface_hub", "pyarrow", "pandas")
    code = f"import sys, data; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == [], f"import data loads {out}"


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("import os\nfrom a import x\n")
    (tmp_path / "d.py").write_text("import a\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path)) is None
