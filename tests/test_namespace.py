"""kvfleet shares an environment with transformers (and so with vLLM): Hugging Face's ``kernels``
distribution, which transformers 5.x imports, is the ``kernels`` every process finds, and kvfleet's
own kernels are ``kvfleet.kernels``, from the repository root and from anywhere else. The installed
wheel is checked the same way in tests/test_wheel.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# transformers' own kernels hub import, a transformers model built and run, and the engine's
# attention entry points, all in one process
PROBE = """
import importlib.metadata, json
import kernels
import transformers.integrations.hub_kernels
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2)
logits = LlamaForCausalLM(config)(torch.tensor([[1, 2, 3]])).logits
import kvfleet.kernels
from kvfleet.compute_service.model import causal_lm
print(json.dumps({"kernels": kernels.__file__, "kernels_dist": importlib.metadata.version("kernels"),
                  "ours": kvfleet.kernels.__file__, "entry_points": all(hasattr(kvfleet.kernels, name)
                  for name in ("paged_prefill", "paged_decode", "store_kv")), "logits": list(logits.shape)}))
"""


@pytest.mark.process
@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_hugging_face_kernels_and_a_transformers_model_work_beside_kvfleet(where, tmp_path):
    cwd = ROOT if where == "repository root" else tmp_path
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["kernels"]).parent.parent.name == "site-packages", found  # Hugging Face's, installed
    assert found["ours"] == str(ROOT / "kvfleet" / "kernels" / "__init__.py"), found  # the editable install
    assert found["entry_points"] and found["logits"] == [1, 3, 64], found


@pytest.mark.process
def test_the_environment_is_consistent():
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.process
def test_the_in_process_demo_serves_from_outside_the_checkout(tmp_path):
    """The command a user runs from their own directory answers every prompt (with a shadowed kernels
    package, each one ended ``-- abort, 0 tokens``)."""
    from kvfleet.cli.model_maker import make_model

    model = make_model(tmp_path / "tiny", "tiny", seed=3)
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "demo", "--in-process", "--model", str(model),
                           "--max-tokens", "4"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    answered = [line for line in done.stdout.splitlines() if " -- length, 4 tokens" in line or " -- stop, " in line]
    assert len(answered) == 4 and "failed" not in done.stdout, done.stdout
