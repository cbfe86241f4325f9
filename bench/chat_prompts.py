"""Real chat prompts for the engine benchmarks, and the host facts each figure is named with.

``chat_prompts`` applies a model's own chat template (``tokenizer_config.json``'s ``chat_template``,
rendered with jinja2 as transformers renders it) to a fixed list of everyday questions and tokenizes
the text with the model's ``tokenizer.json`` (no special tokens added: the template writes its own),
offline. The parent process computes the token ids once and hands the same ids to both sides of a
comparison, so neither side's tokenizer version can make the workloads differ.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

QUESTIONS = (
    "What is the capital of France, and what is it famous for?",
    "Explain how photosynthesis works in simple terms.",
    "Write a short poem about the sea at night.",
    "What are three tips for staying focused while studying?",
    "How does a refrigerator keep food cold?",
    "Give me a recipe for a quick vegetable soup.",
    "Why is the sky blue during the day and red at sunset?",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I write a function in Python that reverses a string?",
    "What should I pack for a weekend hiking trip?",
    "Explain what inflation is and why it matters.",
    "What are the main causes of climate change?",
    "How can I improve my sleep quality?",
    "Describe how a bill becomes a law in the United States.",
    "What is machine learning, and how is it used today?",
)


def render_chat(template: str, question: str) -> str:
    """``template`` (a Jinja chat template) over one user turn, with the assistant's turn opened."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    return env.from_string(template).render(messages=[{"role": "user", "content": question}],
                                            add_generation_prompt=True)


def chat_prompts(model_dir: Path, count: int = len(QUESTIONS)) -> list[list[int]]:
    """Token ids of the first ``count`` questions in ``model_dir``'s chat template. ``ValueError`` in
    one line where the model has no chat template or tokenizer file."""
    from tokenizers import Tokenizer

    config_path, tokenizer_path = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    template = json.loads(config_path.read_text()).get("chat_template") if config_path.is_file() else None
    if not template or not tokenizer_path.is_file():
        raise ValueError(f"{model_dir} has no chat template and tokenizer.json: --prompts chat needs both")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    return [tokenizer.encode(render_chat(template, q), add_special_tokens=False).ids for q in QUESTIONS[:count]]


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` prints it ("unknown" where it cannot be read)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")]
    return names[0] if names else "unknown"


def has_amx() -> bool:
    """Whether the CPU has AMX bfloat16 matrix units (``amx_bf16`` in its flags)."""
    from kvfleet.compute_service.engine.cpu_host import host_cpu_flags

    return "amx_bf16" in host_cpu_flags()
