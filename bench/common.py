"""Shared pieces of the benchmarks: the benchmark model, seeded prompts, child-process runs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_MODEL = ROOT / "models" / "bench-small"


def ensure_model(preset: str = "small", path: Path = BENCH_MODEL) -> Path:
    """``path``, made once (seeded random weights) where it holds no model yet. Benchmarks started
    together (the smoke tests' workers) may all find it missing: each writes a directory of its own
    beside it and renames it into place, so none reads another's half-written weights."""
    if not (path / "config.json").is_file():
        import os
        import shutil

        sys.path.insert(0, str(ROOT))
        from kvfleet.cli.model_maker import make_model

        own = path.with_name(f".{path.name}.{os.getpid()}")
        make_model(own, preset, seed=0)
        try:
            os.rename(own, path)  # atomic; fails where another run's copy (or a stale empty directory) is there
        except OSError:
            shutil.rmtree(own, ignore_errors=True)
            if not (path / "config.json").is_file():
                raise SystemExit(f"{path} holds no complete model (no config.json): remove it") from None
    return path


def engine_dtype() -> str:
    """The dtype the engine resolves ``auto`` to here (``KVFLEET_DEFAULT_DTYPE``, else bfloat16 on a CPU
    with native bfloat16, else float32): a benchmark sizes its pool and names its dtype from this,
    never from the CPU its author had."""
    from kvfleet.compute_service.engine.config import EngineConfig

    return EngineConfig().dtype


def add_smoke_flag(parser) -> None:
    """``--smoke``: the smallest shape (seconds), a check that the benchmark runs end to end (its
    figures mean nothing); tests/bench/test_bench_smoke.py runs every benchmark with it."""
    parser.add_argument("--smoke", action="store_true", help="the smallest shape (seconds): a check that it runs, "
                                                             "not a figure")


def seeded_prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def run_child(script: Path, args: list[str]) -> dict:
    """Run one side of a benchmark in its own process (so its peak memory is its own); its last
    stdout line is a JSON object."""
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{script.name} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_dir_or_none(arg: str | None, prog: str) -> Path | None:
    """The model directory ``--model`` names (default: the pulled SmolLM2), or None where it holds
    no model (said in one line on stderr)."""
    from kvfleet.cli.models_pull import default_model_dir

    model_dir = Path(arg) if arg else default_model_dir()
    if not (model_dir / "config.json").is_file():
        print(f"{prog}: {model_dir} is not a model directory (`make model` pulls SmolLM2)", file=sys.stderr)
        return None
    return model_dir
