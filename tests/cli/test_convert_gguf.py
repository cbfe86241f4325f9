"""``kvfleet convert-gguf`` on the real SmolLM2 file, against transformers' own GGUF loading as the
reference (weights identical, tokenizer identical), and on bad input through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.cli.convert_gguf import unpermute_rope_rows
from kvfleet.cli.models_pull import MODELS, gguf_file, pull

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "The capital of France is Paris.",
    "In 2024, 1234567 people paid $3.50 each!",
    "  leading spaces,\ttabs\nand new lines\n\n",
    "naïve café, 東京, emoji 🙂 and CamelCaseWords",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return gguf_file("smollm2")


@pytest.fixture(scope="module")
def converted() -> Path:
    """The directory `make model` (kvfleet models pull smollm2) wrote; pulled here if it is not yet."""
    return pull("smollm2", ROOT / "models")[0]


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``, as written there."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_unpermute_undoes_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 3, 6):
        assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_weights_identical_to_transformers_gguf_loading(gguf_path, converted):
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own dequantization and reverse permutation, mapped onto its Llama's names
    with torch.device("meta"):
        reference_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted))
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=reference_model)["tensors"]
    ours = load_file(str(converted / "model.safetensors"))
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == np.float32
        assert np.array_equal(ours[name], tensor.numpy()), name


def test_config_and_tokenizer_match_transformers(gguf_path, converted):
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] and config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = AutoTokenizer.from_pretrained(str(converted))
    for text in TEXTS:
        ids = ours(text, add_special_tokens=False).input_ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == text
    assert ours.encode("2024", add_special_tokens=False) == [ours.convert_tokens_to_ids(d) for d in "2024"]
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = ours.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == ours.eos_token_id


@pytest.mark.process
def test_pull_is_idempotent(converted):
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    done = cli("models", "pull", "smollm2", "--models-dir", str(converted.parent))
    assert done.returncode == 0 and "already there" in done.stdout
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert MODELS["smollm2"].directory == converted.name


# -- bad input: one clear line, non-zero exit, nothing left in the output's folder ----------------

def cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvfleet.cli", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def assert_refused(done: subprocess.CompletedProcess, out_parent: Path, words: str) -> None:
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in lines[0] and lines[0].startswith("kvfleet convert-gguf: ")
    assert list(out_parent.iterdir()) == [], "something half-written was left behind"


@pytest.mark.process
def test_missing_file(tmp_path):
    (tmp_path / "out").mkdir()
    done = cli("convert-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "out" / "model"))
    assert_refused(done, tmp_path / "out", "no such file")


@pytest.mark.process
@pytest.mark.parametrize("keep", [3000, 50_000_000], ids=["header", "tensors"])
def test_truncated_file(tmp_path, gguf_path, keep):
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src:
        cut.write_bytes(src.read(keep))
    (tmp_path / "out").mkdir()
    done = cli("convert-gguf", str(cut), "--out", str(tmp_path / "out" / "model"))
    assert_refused(done, tmp_path / "out", "not a readable GGUF file")


@pytest.mark.process
def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "out").mkdir()
    done = cli("convert-gguf", str(path), "--out", str(tmp_path / "out" / "model"))
    assert_refused(done, tmp_path / "out", "architecture 'falcon' is not supported")


@pytest.mark.process
def test_existing_output_is_not_overwritten(tmp_path, gguf_path):
    out = tmp_path / "out" / "model"
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    done = cli("convert-gguf", str(gguf_path), "--out", str(out))
    assert done.returncode != 0 and "already exists" in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
