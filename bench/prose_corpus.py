"""Real English text available offline, tokenized into equal windows, for the FP8 KV benchmarks
(``fp8_accuracy.py``, ``fp8_kv_variants.py``):

    docs      real running text, as KV-quantisation studies teacher-force on: the Python language
              reference shipped in the standard library (``pydoc_data.topics``, 79 topics, ~465K
              characters of English prose with some grammar and code), joined in topic order,
              tokenized once and cut into consecutive windows of ``positions`` tokens, of which
              ``prompts`` evenly spaced ones are taken (the i-th of n: window i x total // n)
    shuffled  seeded shuffles of the 40 unrelated sentences below: real sentences, incoherent text
              (the model is unsure of the next token)

``CHAT_QUESTIONS``: real questions for greedy runs through a model's chat template.
"""

from __future__ import annotations

import random

SENTENCES = [
    "The river rose quickly after three days of heavy rain in the mountains.",
    "She opened the old wooden box and found a stack of letters tied with string.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The committee postponed its decision until the budget report was finished.",
    "A good recipe for bread needs flour, water, salt, yeast and a lot of patience.",
    "In 1969 two astronauts walked on the surface of the Moon for the first time.",
    "The compiler reported an error on line forty-two: a missing closing bracket.",
    "Our train was delayed because a tree had fallen across the tracks near the station.",
    "Prime numbers have exactly two divisors: one and the number itself.",
    "He practised the violin every morning before the rest of the house woke up.",
    "The museum's new exhibition shows maps drawn by sailors in the sixteenth century.",
    "Cats sleep for twelve to sixteen hours a day, mostly in short naps.",
    "To reset the router, hold the button on the back for ten seconds.",
    "The glacier has retreated almost two kilometres since the first survey was made.",
    "A balanced diet includes vegetables, fruit, grains, protein and some healthy fats.",
    "The detective noticed that the clock on the mantelpiece had stopped at midnight.",
    "Interest rates affect how much it costs to borrow money for a house or a car.",
    "The children built a sandcastle with towers, a moat and a little flag on top.",
    "Water boils at one hundred degrees Celsius at sea level, and lower on a mountain.",
    "The library will be closed on Monday for the installation of new shelves.",
    "Volcanoes form where magma from deep inside the Earth reaches the surface.",
    "The orchestra tuned their instruments while the audience found their seats.",
    "A database index makes lookups faster at the cost of slower writes and more space.",
    "The farmer checked the weather forecast before deciding when to harvest the wheat.",
    "Shakespeare wrote thirty-seven plays, among them Hamlet, Macbeth and King Lear.",
    "The startup hired five engineers to rebuild its payment system from scratch.",
    "Migrating birds use the stars, the sun and the Earth's magnetic field to navigate.",
    "Please send me the quarterly figures by Friday so I can prepare the presentation.",
    "The bridge was painted bright red so that ships could see it through the fog.",
    "Vaccines train the immune system to recognise a virus before an infection.",
    "The chess player sacrificed her queen and won the game four moves later.",
    "Every function in this module returns a new list instead of changing its input.",
    "The old lighthouse keeper wrote down the weather in a notebook every evening.",
    "Electric cars convert most of the energy in their batteries into motion.",
    "The soup needs more salt, a little pepper and a handful of fresh parsley.",
    "Tectonic plates move only a few centimetres each year, about as fast as nails grow.",
    "The meeting ran long because everyone wanted to discuss the new office layout.",
    "He translated the poem from Spanish, keeping its rhythm as well as its meaning.",
    "Honey never spoils: jars found in ancient tombs were still safe to eat.",
    "The software update fixed the battery drain but introduced a new display bug.",
]
CHAT_QUESTIONS = [
    "What causes the seasons on Earth?",
    "Explain in two sentences what a hash table is.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Give me three tips for a job interview.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
]


def shuffled_prompts(tokenizer, count: int, positions: int, seed: int = 0) -> list[list[int]]:
    """``count`` token lists of exactly ``positions`` tokens: each a seeded shuffle of the sentences
    (repeated until long enough), so every prompt is different real text."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < positions:
            sentences = SENTENCES[:]
            rng.shuffle(sentences)
            ids += tokenizer.encode(" ".join(sentences) + " ")
        prompts.append(ids[:positions])
    return prompts


def docs_prompts(tokenizer, count: int, positions: int) -> list[list[int]]:
    """``count`` windows of ``positions`` consecutive tokens of the Python language reference
    (``pydoc_data.topics``, topics in sorted order), evenly spaced over the whole text."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics)))
    total = len(ids) // positions
    if total < count:
        raise SystemExit(f"the docs corpus has {total} windows of {positions} tokens; asked for {count}")
    return [ids[w * positions:(w + 1) * positions] for w in (i * total // count for i in range(count))]


CORPORA = {"docs": docs_prompts, "shuffled": shuffled_prompts}  # (tokenizer, count, positions) → prompts
