"""Layers point down and files import no cycle (docs/architecture.md has the picture).
Every `import trace_rl.…` counts, also the ones inside functions."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["core", "models", "sandbox", "agents", "evals", "training", "graph", "prompts"]
# lowest first; a module may import its own layer and the ones below it
LAYERS = ["core", "prompts", "sandbox", "models", "agents.base_agent", "evals", "agents", "training", "graph"]


def layer(module: str) -> int:
    """The layer of trace_rl.<module>: the longest LAYERS entry it starts with."""
    best = max((x for x in LAYERS if module == x or module.startswith(x + ".")), key=len)
    return LAYERS.index(best)


def imports() -> dict[str, set[str]]:
    """{module: trace_rl modules it imports}, modules named without the trace_rl. prefix."""
    out = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if "image" in path.parts or "envs" in path.parts:  # sandbox payloads: stdlib only, run in the container
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trace_rl"):
                    base = node.module.removeprefix("trace_rl").lstrip(".")
                    for alias in node.names:  # `from trace_rl.models import weights` imports models.weights
                        full = f"{base}.{alias.name}" if base else alias.name
                        deps.add(full if any(p.with_suffix("").relative_to(ROOT).parts == tuple(full.split("."))
                                             for p in ROOT.glob(full.replace(".", "/") + ".py")) else base)
                elif isinstance(node, ast.Import):
                    deps |= {a.name.removeprefix("trace_rl.") for a in node.names if a.name.startswith("trace_rl.")}
            out[name] = {d for d in deps if d and d != name}
    return out


def test_no_module_imports_a_layer_above_its_own():
    bad = [f"{m} ({LAYERS[layer(m)]}) imports {d} ({LAYERS[layer(d)]})"
           for m, deps in imports().items() for d in sorted(deps) if layer(d) > layer(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_files():
    graph = imports()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_layer_check_sees_the_imports_it_must():
    """The checker itself: lazy imports inside functions count, and the known edges are found."""
    graph = imports()
    assert "models.llm" in graph["agents.analyst"] and "evals.rollout" in graph["training.train"]
    assert "agents.base_agent" in graph["evals.rollout"]  # a lazy-free edge one layer down
    assert "models.llama_server" in graph["models.llm"]  # lazy, inside a function
    assert layer("agents.base_agent") < layer("evals") < layer("agents.analyst")
    assert layer("models") < min(layer("agents.base_agent"), layer("evals"), layer("training"))


def test_core_imports_nothing_of_the_project_but_core():
    """core/ is types and files: every other folder may use it, it uses none of them."""
    bad = [f"{m} imports {d}" for m, deps in imports().items() if m.startswith("core")
           for d in sorted(deps) if not d.startswith("core")]
    assert not bad, "\n".join(bad)


def test_importing_the_package_does_not_import_ray():
    """Ray is an optional extra (#44): only executor=ray imports it (evals/executor.py, when asked)."""
    import subprocess
    import sys

    code = ("import sys, trace_rl.evals.executor, trace_rl.evals.rollout, trace_rl.evals.evaluate, "
            "trace_rl.graph.pipeline, trace_rl.graph.cli\n"
            "print([m for m in sys.modules if m == 'ray' or m.startswith('ray.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
