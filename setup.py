"""Build hook: the wheel carries the generated ``kvfleet.v1`` stubs.

``protos/`` is the only source of the wire format and the stubs are not committed (``/kvfleet/v1/``
is ignored), so ``build_py`` runs ``grpc_tools.protoc`` itself: into the build directory for a
wheel (a ``pip install .`` then imports ``kvfleet.v1`` from site-packages, no ``make protos`` and no
source folder needed), into the source tree for an editable install (where ``make protos`` puts them).
Everything else is declared in pyproject.toml; the kernels' C++ sources travel as package data.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class build_py_with_stubs(build_py):  # noqa: N801 - setuptools' command naming
    def run(self) -> None:
        super().run()
        target = ROOT if self.editable_mode else Path(self.build_lib)
        self._stubs = generate_stubs(target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *map(str, getattr(self, "_stubs", []))]


def generate_stubs(target: Path) -> list[Path]:
    """Run protoc over ``protos/kvfleet/v1/*.proto`` into ``target``; the files it wrote. A failure
    stops the build: a wheel without its stubs cannot serve anything."""
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos" / "kvfleet" / "v1").glob("*.proto"))
    if not protos:
        raise SystemExit("no .proto files under protos/kvfleet/v1: cannot generate the kvfleet.v1 stubs")
    (target / "kvfleet" / "v1").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={target}",
                    f"--pyi_out={target}", f"--grpc_python_out={target}", *protos], cwd=ROOT, check=True)
    return sorted((target / "kvfleet" / "v1").glob("*_pb2*.py*"))


setup(cmdclass={"build_py": build_py_with_stubs})
