"""The package declares what it imports, and imports what it declares.

A hard dependency that nothing imports costs every user an install (and its conflicts); an import that no
dependency brings breaks on a clean machine; a floor below what the code uses breaks an older install at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("radix", "constrained", "runtime", "server", "lang")
# Declared but used without an import of ours.
TOOLS = {
    "ninja": "torch's C++ extension builder runs it to build the CPU attention kernel",
    "accelerate": "transformers needs it to read a GGUF file's weights (runtime/gguf_convert.py)",
}
# Import names whose distribution is named otherwise, for distributions that may not be installed here.
DIST_OF = {"agents": "openai-agents", "llama_cpp": "llama-cpp-python", "yaml": "pyyaml"}
# What the code needs of torch, and the first release that has it.
TORCH_FLOOR = Version("2.5")  # F.scaled_dot_product_attention(enable_gqa=...)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _imports(folders: tuple[str, ...]) -> set[str]:
    """Top-level modules imported anywhere under ``folders`` (lazy imports inside functions too)."""
    found: set[str] = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    found.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    local = set(PACKAGES) | {"radixserve", "tests", "bench", "examples"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in local}


def _distributions(modules: set[str]) -> set[str]:
    installed = packages_distributions()
    dists = set()
    for module in modules:
        names = installed.get(module) or [DIST_OF.get(module, module.replace("_", "-"))]
        dists.update(canonicalize_name(n) for n in names)
    return dists


def test_hard_dependencies_are_what_the_package_imports() -> None:
    project = _project()
    declared = _names(project["dependencies"])
    optional = set().union(*(_names(deps) for deps in project["optional-dependencies"].values()))
    imported = _distributions(_imports(PACKAGES))
    unused = declared - imported - set(TOOLS)
    assert not unused, f"declared but never imported by the package: {sorted(unused)}"
    undeclared = imported - declared - optional
    assert not undeclared, f"imported by the package but declared nowhere: {sorted(undeclared)}"


def test_the_dev_extra_brings_what_the_tests_import() -> None:
    project = _project()
    available = _names(project["dependencies"]) | _names(project["optional-dependencies"]["dev"])
    # Transitive-only distributions a test may import through its parent (pytest brings its plugins' hooks).
    missing = _distributions(_imports(("tests",))) - available - {"pytest"}
    assert not missing, f"imported by the tests but not in the dev extra: {sorted(missing)}"


def test_the_torch_floor_has_what_the_code_uses() -> None:
    torch_req = next(Requirement(r) for r in _project()["dependencies"] if Requirement(r).name == "torch")
    floors = [Version(s.version) for s in torch_req.specifier if s.operator in (">=", "==", "~=")]
    assert floors and max(floors) >= TORCH_FLOOR, f"torch{torch_req.specifier} allows a torch without enable_gqa"


def test_the_package_installs_under_one_namespace(tmp_path: Path) -> None:
    """``pip install .``: the code imports as ``radixserve.*`` and no top-level ``server``, ``runtime``, ... exists
    to collide with other packages; ``pip check`` is clean. (A venv over this environment's packages, so that the
    dependencies need no download; the install itself is a real, non-editable one.)"""
    venv = tmp_path / "venv"
    # Without its own pip and setuptools: the environment's (a venv's bundled setuptools may be too old to build).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(ROOT)], check=True, cwd=tmp_path)
    probe = (
        "import importlib.util as u, radixserve.server, radixserve.runtime.engine_api\n"
        "print(radixserve.server.__file__)\n"
        "print([n for n in ('server', 'runtime', 'radix', 'constrained', 'lang') if u.find_spec(n)])\n"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    location, top_level = out.splitlines()
    assert location.startswith(str(venv)), location  # the installed copy, not this checkout
    assert top_level == "[]", f"top-level packages installed: {top_level}"
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    script = subprocess.run([str(venv / "bin" / "radixserve"), "serve", "--help"], capture_output=True, text=True)
    assert script.returncode == 0 and "--max-total-tokens" in script.stdout, script.stderr
