"""``kvfleet plan`` from the command line: the JSON names scripts rely on, a table for people, and
bad input answered in one line with a non-zero exit."""

from __future__ import annotations

import json

import pytest

from kvfleet.cli import cli
from kvfleet.cli.planning.shapes import PRESETS


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_plans_to_json_with_the_names_scripts_rely_on(capsys, preset):
    code, out, _ = run(capsys, "--preset", preset, "--device", "h200", "--tensor-parallel", "8", "--context", "8192",
                       "--target-tokens-per-s", "3000", "--concurrency", "128", "--json")
    assert code == 0
    plan = json.loads(out)
    for key in ("kv_bytes_per_token", "weights_bytes", "blocks_per_seq", "max_concurrent_seqs", "devices_needed"):
        assert isinstance(plan[key], int), key
    assert plan["blocks_per_seq"] == 8192 // 256
    assert [s["name"] for s in plan["scenarios"]] == ["chat", "code", "document"]


def test_the_table_prints_the_formula_with_its_numbers(capsys):
    code, out, _ = run(capsys, "--preset", "llama-3.1-8b", "--device", "a100-80g", "--context", "1000",
                       "--block-size", "document", "--target-tokens-per-s", "1500")
    assert code == 0
    assert "2 x 32 layers x 8 kv_heads x 128 head_dim x 2 B = 131,072 B" in out
    assert "the last wastes 24 tokens" in out
    assert "1 x A100-80G" in out and "devices needed" in out


def test_device_memory_and_kv_dtype_change_the_capacity(capsys):
    _, out, _ = run(capsys, "--preset", "mistral-7b", "--device-memory", str(40 << 30), "--kv-cache-dtype", "fp8_e4m3",
                    "--context", "4096", "--json")
    plan = json.loads(out)
    assert plan["kv_bytes_per_token"] == 2 * 32 * 8 * (128 * 1 + 4)  # FP8 elements + a float32 scale per row
    assert plan["device"].startswith("H100-80G (42,949,672,960 B)")


@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--preset", "gpt-5"], "unknown preset 'gpt-5'; known: llama-3.1-8b"),
    (["--preset", "mistral-7b", "--device", "tpu-v5"], "known: a100-80g, cpu, h100-80g, h200, l40s"),
    (["--preset", "mistral-7b", "--context", "65536"], "longer than Mistral-7B-v0.3's 32,768 positions"),
    (["--preset", "mistral-7b", "--block-size", "100"], "multiple of 16"),
    (["--preset", "mistral-7b", "--tensor-parallel", "0"], "--tensor-parallel"),
    (["--preset", "mistral-7b", "--target-tokens-per-s", "-5"], "--target-tokens-per-s"),
    (["--preset", "mistral-7b", "--device-memory", "0"], "--device-memory"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(capsys, args, says):
    code, out, err = run(capsys, *args)
    assert code == 2 and not out
    assert says in err and err.count("\n") == 1


def test_a_directory_without_config(capsys, tmp_path):
    code, _, err = run(capsys, "--model", str(tmp_path))
    assert code == 2 and "config.json is missing" in err


def test_force_plans_past_the_models_positions(capsys):
    code, out, _ = run(capsys, "--preset", "mistral-7b", "--context", "65536", "--force", "--json")
    assert code == 0 and "32,768 positions" in json.loads(out)["warnings"][0]


def test_an_mla_model_directory(capsys, tmp_path):
    config = dict(model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
                  num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                  max_position_embeddings=163840, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                  num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3,
                  tie_word_embeddings=False, torch_dtype="bfloat16",
                  quantization_config=dict(quant_method="fp8", fmt="e4m3"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, out, _ = run(capsys, "--model", str(tmp_path), "--context", "4096", "--json")
    from_dir = json.loads(out)
    _, out, _ = run(capsys, "--preset", "deepseek-v3", "--context", "4096", "--json")
    preset = json.loads(out)
    for key in ("kv_bytes_per_token", "weights_bytes", "num_active_params", "max_concurrent_seqs"):
        assert from_dir[key] == preset[key], key


@pytest.mark.parametrize("config, says", [
    (dict(model_type="deepseek_v3", kv_lora_rank=512), "field 'num_attention_heads' must be an integer, got None"),
    (dict(model_type="gpt2", n_layer=12), "model_type 'gpt2' is not supported"),
])
def test_a_config_the_plan_cannot_read_is_one_line(capsys, tmp_path, config, says):
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run(capsys, "--model", str(tmp_path))
    assert code == 2 and not out and says in err and err.count("\n") == 1
