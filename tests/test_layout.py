"""The layout of the code: the import graph, function lengths and the top level of jaxllm/, read with ``ast``
by scripts/code_stats.py (which prints the same figures)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.code_stats import (LONG_FUNCTION, NATIVE_DRIVER, _modules, functions, house, import_cycles,
                                import_graph, top_level)

ROOT = Path(__file__).resolve().parents[1]


def test_jaxllm_modules_import_no_cycle_and_the_front_end_no_jax():
    graph = import_graph(ROOT)
    cycles = import_cycles(graph)
    assert cycles == [], "import cycle: " + "; ".join(" -> ".join(c) for c in cycles)
    # What the server's front end imports when it starts: no JAX (the engine core's processes hold it).
    toplevel = import_graph(ROOT, toplevel_only=True)
    front_end = ["jaxllm.frontend.async_llm", "jaxllm.entrypoints.openai.api_server", "jaxllm.entrypoints.openai.serving"]
    # A module's packages are no edge of it in the graph, but importing it runs their __init__ first.
    packages = [m.rsplit(".", k)[0] for m in front_end for k in range(1, m.count(".") + 1)]
    seen, todo = set(), front_end + packages
    while todo:
        module = todo.pop()
        if module not in seen and module in toplevel:
            seen.add(module)
            todo += toplevel[module]
    assert "jaxllm.core.client" in seen and "jaxllm.tokenizer" in seen
    assert not {m for m in seen if "jax" in toplevel[m]}, sorted(m for m in seen if "jax" in toplevel[m])


# A package a boundary: the scheduler knows nothing of JAX, the kernels nothing of the scheduler or the models.
@pytest.mark.parametrize(("package", "forbidden"), [("scheduler", {"jaxllm", "jax"}),
                                                     ("kernels_pallas", {"jaxllm", "scheduler"})])
def test_scheduler_and_kernels_pallas_import_no_jaxllm(package, forbidden):
    graph = import_graph(ROOT, package, type_checking=True)
    assert len(graph) > 5
    assert {m: sorted(t & forbidden) for m, t in graph.items() if t & forbidden} == {}


# Which package may import which, by the import graph of jaxllm (imports inside functions count; those under
# `if TYPE_CHECKING:` never run). The engine core's side, of which the front end may import the messages and the
# client only: LLMEngine alone builds its one in-process core, inside its constructor.
ENGINE_SIDE = ("jaxllm.core", "jaxllm.worker", "jaxllm.models", "jaxllm.loader", "jaxllm.sample", "jaxllm.spec_decode")
FRONT_END_MAY_IMPORT = {"jaxllm.core", "jaxllm.core.messages", "jaxllm.core.client"}
FRONT_END_EXCEPTIONS = {("jaxllm.frontend.llm_engine", "jaxllm.core.build")}


# The one module that loads the C++ kernels (kernels_pallas.cpu_build): the ops table, which picks the backend per op
# and registers the FFI targets each C++ backend declares.
CPP_DRIVER_IMPORTERS = ["kernels_pallas.ops"]


def test_only_the_ops_table_imports_the_cpp_driver():
    assert house(ROOT)["native_driver_importers"] == CPP_DRIVER_IMPORTERS
    # The scripts too reach the kernels' build through the table.
    scripts = {module for module, (_, tree) in _modules(ROOT, "scripts").items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module and NATIVE_DRIVER in
               {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
               or isinstance(node, ast.Import) and NATIVE_DRIVER in {a.name for a in node.names}}
    assert len(_modules(ROOT, "scripts")) > 5 and scripts == set()


def test_config_imports_only_the_standard_library_and_the_scheduler():
    imported = import_graph(ROOT)["jaxllm.config"]
    assert "dataclasses" in imported
    assert imported - set(sys.stdlib_module_names) == {"scheduler"}


def test_the_front_end_imports_only_the_cores_messages_and_client_of_the_engine_side():
    graph = import_graph(ROOT)
    assert len([m for m in graph if m.startswith("jaxllm.frontend.")]) > 5
    found = {(m, t) for m, targets in graph.items() if m.startswith("jaxllm.frontend") for t in targets
             if t.startswith(ENGINE_SIDE) and t not in FRONT_END_MAY_IMPORT}
    assert found == FRONT_END_EXCEPTIONS


BLOCK_JAX_ZMQ_MSGSPEC = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "zmq", "msgspec"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Blocker())
"""


def test_config_and_the_scheduler_tests_load_without_jax_pyzmq_or_msgspec():
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_scheduler_*.py"))
    run = BLOCK_JAX_ZMQ_MSGSPEC + (
        "import jaxllm.config, jaxllm.entrypoints.engine_args, scheduler\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['--co', '-q', '-p', 'no:cacheprovider', *{tests!r}, 'tests/test_engine_config.py']))")
    proc = subprocess.run([sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True)
    assert len(tests) > 5
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR" not in proc.stdout and " tests collected in " in proc.stdout


@pytest.mark.parametrize("package", ["jaxllm", "scheduler"])
def test_no_function_exceeds_100_lines(package):
    found = functions(ROOT, package)
    assert len(found) > 100
    assert [f for f in found if f.lines > LONG_FUNCTION] == []


def test_jaxllm_top_level_holds_at_most_20_modules_and_folders():
    top = top_level(ROOT)
    assert "config.py" in top["modules"] and {"core", "frontend", "worker", "sample"} <= set(top["packages"])
    assert len(top["modules"]) + len(top["packages"]) <= 20


def test_code_stats_prints_the_figures_as_json_without_importing_jax():
    run = ("import runpy, sys; sys.argv = ['code_stats.py', '--json'];"
           " runpy.run_path('scripts/code_stats.py', run_name='__main__'); assert 'jax' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True, check=True)
    stats = json.loads(proc.stdout)
    assert stats["top_level"]["count"] == sum(map(len, top_level(ROOT).values()))
    assert stats["imports"]["cycles"] == [] and stats["imports"]["longest_chain"][0].startswith("jaxllm.")
    assert stats["tracked"]["EngineCore.step"]["path"] == "jaxllm/core/engine_core.py"
    assert stats["tracked"]["Scheduler.schedule"]["path"] == "scheduler/scheduler.py"


def test_engine_core_step_reads_as_schedule_launch_apply_report_in_at_most_30_lines():
    step = next(f for f in functions(ROOT, "jaxllm") if f.qualname == "EngineCore.step")
    assert step.path == "jaxllm/core/engine_core.py" and step.lines <= 30
