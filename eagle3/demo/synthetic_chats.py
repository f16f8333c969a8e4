"""Synthetic multi-turn chats: the demo's shipped set and the benchmarks' inputs.

`python -m eagle3.demo.synthetic_chats` rewrites data/demo_chats.jsonl, the small chat
set the demo ships with (committed, so the demo never depends on this module);
`bench/` generates larger sets with `write_jsonl`. Deterministic: seeded, no clock, no network.
The conversations are synthetic and formulaic on purpose: a tiny target trained on
them becomes a teacher whose next token is predictable, which is what a drafter
demo needs. Two record shapes are written, as users have them: OpenAI `messages`
and ShareGPT `conversations`.
"""
import json
import random
from pathlib import Path

from eagle3.artifacts.workdir import REPO_ROOT

COUNTRIES = {
    "France": ("Paris", "euro", "French"), "Japan": ("Tokyo", "yen", "Japanese"),
    "Italy": ("Rome", "euro", "Italian"), "Spain": ("Madrid", "euro", "Spanish"),
    "Germany": ("Berlin", "euro", "German"), "Egypt": ("Cairo", "pound", "Arabic"),
    "Canada": ("Ottawa", "dollar", "English and French"), "Peru": ("Lima", "sol", "Spanish"),
    "Kenya": ("Nairobi", "shilling", "Swahili and English"), "Norway": ("Oslo", "krone", "Norwegian"),
    "Brazil": ("Brasilia", "real", "Portuguese"), "India": ("New Delhi", "rupee", "Hindi and English"),
    "Chile": ("Santiago", "peso", "Spanish"), "Greece": ("Athens", "euro", "Greek"),
    "Poland": ("Warsaw", "zloty", "Polish"), "Vietnam": ("Hanoi", "dong", "Vietnamese"),
}
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
ANIMALS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack", "sheep": "baa",
           "owl": "hoot", "lion": "roar", "frog": "ribbit"}
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one or two sentences.",
    "You are a friendly tutor who explains things step by step.",
]


def arithmetic(rng):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["plus", "minus", "times"])
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return (f"What is {a} {op} {b}?",
            f"{a} {op} {b} is {value}. So the answer is {value}.")


def capital(rng):
    country = rng.choice(sorted(COUNTRIES))
    city, currency, language = COUNTRIES[country]
    kind = rng.choice(["capital", "currency", "language"])
    if kind == "capital":
        return (f"What is the capital of {country}?",
                f"The capital of {country} is {city}.")
    if kind == "currency":
        return (f"Which currency is used in {country}?",
                f"The currency used in {country} is the {currency}.")
    return (f"What language is spoken in {country}?",
            f"The main language spoken in {country} is {language}.")


def spelling(rng):
    word = rng.choice(sorted(COUNTRIES) + COLORS + sorted(ANIMALS))
    letters = ", ".join(word.upper())
    return (f"How do you spell {word}?",
            f"The word {word} is spelled {letters}. It has {len(word)} letters.")


def counting(rng):
    start, n = rng.randint(1, 40), rng.randint(3, 8)
    numbers = ", ".join(str(start + i) for i in range(n))
    return (f"Count from {start} to {start + n - 1}.",
            f"Sure, here is the count: {numbers}.")


def animal(rng):
    name = rng.choice(sorted(ANIMALS))
    return (f"What sound does a {name} make?",
            f"A {name} says {ANIMALS[name]}. The sound of a {name} is {ANIMALS[name]}.")


def colors(rng):
    picked = rng.sample(COLORS, 3)
    return (f"List three colors, starting with {picked[0]}.",
            f"Here are three colors: {picked[0]}, {picked[1]} and {picked[2]}.")


TOPICS = [arithmetic, capital, spelling, counting, animal, colors]
FOLLOW_UPS = [("Thanks!", "You are welcome. Let me know if you have another question."),
              ("Can you repeat that?", None)]


def conversation(rng):
    turns = []
    for _ in range(rng.choice([1, 1, 2, 2, 3])):
        question, answer = rng.choice(TOPICS)(rng)
        turns += [("user", question), ("assistant", answer)]
    if rng.random() < 0.25:
        follow, reply = rng.choice(FOLLOW_UPS)
        turns += [("user", follow), ("assistant", reply or f"Of course. {turns[-1][1]}")]
    system = rng.choice(SYSTEMS) if rng.random() < 0.3 else None
    return system, turns


def to_openai(system, turns):
    messages = ([{"role": "system", "content": system}] if system else [])
    return {"messages": messages + [{"role": r, "content": c} for r, c in turns]}


def to_sharegpt(system, turns):
    speaker = {"user": "human", "assistant": "gpt"}
    convs = ([{"from": "system", "value": system}] if system else [])
    return {"conversations": convs + [{"from": speaker[r], "value": c} for r, c in turns]}


def write_jsonl(out: Path, n: int, seed: int = 20261129) -> Path:
    rng = random.Random(seed)
    with open(out, "w") as f:
        for i in range(n):
            system, turns = conversation(rng)
            record = to_sharegpt(system, turns) if i % 4 == 3 else to_openai(system, turns)
            record["id"] = f"demo-{i:04d}"
            f.write(json.dumps(record) + "\n")
    return out


if __name__ == "__main__":
    write_jsonl(REPO_ROOT / "data" / "demo_chats.jsonl", 400)
