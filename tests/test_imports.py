"""The top-level files import each other one way: no module imports another that imports it back,
directly or through others, at the top or inside a function (a lazy import is still a cycle: it
works only while the modules happen to load in one order)."""
import ast
import glob
import os

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
    assert {"train", "eval", "checkpoint", "downstream", "hf_export", "prepare_data", "fileio",
            "configurator"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    # The ground floor (the README: each imports nothing of the project), and the file users copy alone.
    for module in ("fileio", "configurator", "init"):
        assert not graph[module], f"{module}.py imports {', '.join(sorted(graph[module]))}"
    for reader in ("downstream", "hf_export", "checkpoint"):  # checkpoint readers stand below train.py
        assert "train" not in graph[reader], f"{reader}.py imports train.py"


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("import os\nfrom a import x\n")
    (tmp_path / "d.py").write_text("import a\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path)) is None
