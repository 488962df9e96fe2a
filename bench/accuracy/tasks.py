"""RULER-style synthetic long-context tasks, generated locally from a seed.

Every generator takes ``(target_tokens, seed, render, count_tokens)``: ``render`` wraps the user
message into the final prompt text (the tokenizer's chat template, or the identity in tests) and
``count_tokens`` measures that text; the haystack is grown line by line (bisection) to the
largest prompt of at most ``target_tokens`` tokens. The same seed always gives the same sample.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.accuracy.prose import fit, insert_at_depths, prose_lines, window

Render = Callable[[str], str]
CountTokens = Callable[[str], int]

#: Depth of the asked needle for sample seeds 0, 1, 2, ... (cycled).
DEPTHS = (0.1, 0.5, 0.9, 0.3, 0.7)
ADJECTIVES = ("amber", "silent", "crimson", "hollow", "frozen", "golden", "rapid", "gentle",
              "bitter", "lucky", "ancient", "hidden", "brave", "quiet", "wild", "velvet")
NOUNS = ("falcon", "harbor", "lantern", "meadow", "glacier", "compass", "orchid", "anchor",
         "canyon", "ember", "willow", "beacon", "thistle", "comet", "otter", "summit")
FIRST = ("Elena", "Tomas", "Ingrid", "Rafael", "Mirela", "Oskar", "Lucia", "Henrik", "Amara")
LAST = ("Marsh", "Okafor", "Lindqvist", "Serrano", "Dumont", "Halloran", "Vesely", "Takeda")
ANIMALS = ("heron", "badger", "lynx", "tortoise", "raven", "stag", "salmon", "beetle")
COLORS = ("blue", "green", "scarlet", "silver", "violet", "orange", "white", "black")


@dataclass(frozen=True)
class Sample:
    """One prompt and what its answer must contain.

    ``prompt`` is the rendered text (chat template applied) of ``prompt_tokens`` tokens;
    ``expected`` are the values a correct answer contains, ``forbidden`` distractor values it
    must not; ``depths`` are where the inserts sit in the haystack (0 = start, 1 = end).
    """

    task: str
    seed: int
    target_tokens: int
    prompt: str
    prompt_tokens: int
    question: str
    expected: tuple[str, ...]
    forbidden: tuple[str, ...] = ()
    depths: tuple[float, ...] = ()
    max_tokens: int = 16
    meta: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """JSON-ready fields, without the (long) prompt text."""
        out = asdict(self)
        del out["prompt"]
        return out


def _rng(task: str, seed: int) -> random.Random:
    """A generator seeded by task and seed (so tasks with the same seed differ)."""
    return random.Random(f"{task}:{seed}")


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct ``adjective-noun`` keys."""
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def _distinct_numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    values: list[str] = []
    while len(values) < n:
        v = _number(rng, digits)
        if v not in values:
            values.append(v)
    return values


def _haystack_prompt(rng: random.Random, inserts: list[tuple[float, str]], question: str,
                     target: int, render: Render, count_tokens: CountTokens) -> tuple[str, int]:
    """The rendered prompt of at most ``target`` tokens: instruction, prose with ``inserts``
    at their depths, question; and its token count."""
    start = rng.randrange(len(prose_lines()))
    # Tokens per line, for lines enough to overshoot the target (the bisection's upper bound).
    weights: list[int] = []
    while sum(weights) <= target:
        weights.append(count_tokens(window(start + len(weights), 1)[0]))

    def build(n: int) -> str:
        doc = insert_at_depths(window(start, n), inserts, weights)
        return render(f"Read the following document carefully.\n\n{doc}\n\n{question}")

    _, prompt = fit(build, count_tokens, target, hi=len(weights))
    return prompt, count_tokens(prompt)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def niah_single(target: int, seed: int, render: Render, count_tokens: CountTokens) -> Sample:
    """Single needle: one ``key -> 7-digit number`` sentence at depth ``DEPTHS[seed]``."""
    rng = _rng("niah_single", seed)
    depth = DEPTHS[seed % len(DEPTHS)]
    key, value = _keys(rng, 1)[0], _number(rng)
    question = (f"What is the special magic number for {key} mentioned in the document? "
                "Answer with the number only.")
    prompt, n = _haystack_prompt(rng, [(depth, _needle(key, value))], question, target, render,
                                 count_tokens)
    return Sample("niah_single", seed, target, prompt, n, question, (value,), depths=(depth,))


def niah_multikey(target: int, seed: int, render: Render, count_tokens: CountTokens) -> Sample:
    """Multi-key needle: four needles with distinct keys; the asked one at ``DEPTHS[seed]``,
    three distractors elsewhere (naming a distractor's value scores 0)."""
    rng = _rng("niah_multikey", seed)
    depth = DEPTHS[seed % len(DEPTHS)]
    keys, values = _keys(rng, 4), _distinct_numbers(rng, 4)
    depths = [depth] + [rng.uniform(0.05, 0.95) for _ in range(3)]
    question = (f"What is the special magic number for {keys[0]} mentioned in the document? "
                "Answer with the number only.")
    inserts = [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values, strict=True)]
    prompt, n = _haystack_prompt(rng, inserts, question, target, render, count_tokens)
    return Sample("niah_multikey", seed, target, prompt, n, question, (values[0],),
                  forbidden=tuple(values[1:]), depths=tuple(depths), meta={"keys": keys})


def niah_multivalue(target: int, seed: int, render: Render, count_tokens: CountTokens
                    ) -> Sample:
    """Multi-value needle: one key with four values at four depths; all must be returned."""
    rng = _rng("niah_multivalue", seed)
    key, values = _keys(rng, 1)[0], _distinct_numbers(rng, 4)
    first = DEPTHS[seed % len(DEPTHS)]
    depths = [first] + [rng.uniform(0.05, 0.95) for _ in range(3)]
    question = (f"What are all the special magic numbers for {key} mentioned in the document? "
                "List every one of them, separated by commas.")
    inserts = [(d, _needle(key, v)) for d, v in zip(depths, values, strict=True)]
    prompt, n = _haystack_prompt(rng, inserts, question, target, render, count_tokens)
    return Sample("niah_multivalue", seed, target, prompt, n, question, tuple(values),
                  depths=tuple(depths), max_tokens=48)


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def variable_tracking(target: int, seed: int, render: Render, count_tokens: CountTokens
                      ) -> Sample:
    """Variable tracking: a chain ``VAR A = 12345``, ``VAR B = A``, ... (5 hops) spread over
    the document, interleaved with a distractor chain of another value; every variable of the
    asked chain must be named."""
    rng = _rng("variable_tracking", seed)
    names = _var_names(rng, 10)
    chain, other = names[:5], names[5:]
    value, other_value = _distinct_numbers(rng, 2, digits=5)
    inserts: list[tuple[float, str]] = []
    for ci, (vars_, val) in enumerate(((chain, value), (other, other_value))):
        for i, var in enumerate(vars_):
            rhs = val if i == 0 else vars_[i - 1]
            inserts.append(((i + 0.3 + 0.4 * ci) / len(vars_), f"VAR {var} = {rhs}"))
    question = (f"Find all variables that are assigned the value {value} in the document, "
                "directly or through another variable. Answer with their names only.")
    prompt, n = _haystack_prompt(rng, inserts, question, target, render, count_tokens)
    return Sample("variable_tracking", seed, target, prompt, n, question, tuple(chain),
                  depths=tuple(d for d, _ in inserts[:5]), max_tokens=40,
                  meta={"value": value, "distractor_chain": other})


@functools.lru_cache(maxsize=1)
def _word_pool() -> tuple[str, ...]:
    """Distinct lowercase words (4-9 letters) of the prose corpus, in order of appearance."""
    seen: dict[str, None] = {}
    for line in prose_lines():
        for w in re.findall(r"\b[a-z]{4,9}\b", line):
            seen.setdefault(w, None)
    return tuple(seen)


def common_words(target: int, seed: int, render: Render, count_tokens: CountTokens,
                 top: int = 5, common_freq: int = 30, rare_freq: int = 3) -> Sample:
    """Common-words extraction: a numbered word list in which ``top`` words occur
    ``common_freq`` times each among rare words occurring ``rare_freq`` times; the ``top`` most
    common words must be named. The number of rare words is fitted to the target."""
    rng = _rng("common_words", seed)
    words = rng.sample(_word_pool(), min(len(_word_pool()), 4 * target // (3 * rare_freq) + top))
    common, rare = words[:top], words[top:]
    question = (f"What are the {top} most common words in the list above? "
                "Answer with the words only, separated by commas.")

    def build(n: int) -> str:
        items = common * common_freq + rare[:n] * rare_freq
        random.Random(f"common_words:{seed}:{n}").shuffle(items)
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return render("Below is a numbered list of words. Some of them appear more often than "
                      f"others; remember the ones that appear most often.\n\n{listing}\n\n"
                      f"{question}")

    n_rare, prompt = fit(build, count_tokens, target, hi=len(rare))
    return Sample("common_words", seed, target, prompt, count_tokens(prompt), question,
                  tuple(common), max_tokens=32, meta={"rare_words": n_rare})


RULER_CWE = ("Below is a numbered list of words. In these words, some appear more often than "
             "others. Memorize the ones that appear most often.\n{context}\nQuestion: What "
             "are the 10 most common words in the above list?")
"""RULER's common-words template (``common_words_extraction``), its query left empty."""
RULER_CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
"""RULER's answer prefix, written after the prompt (the model continues it)."""


def _cwe_list(rng: random.Random, pool: list[str], n_words: int, common_repeats: int,
              uncommon_repeats: int, common: int = 10) -> tuple[str, list[str]]:
    """RULER's ``get_example``: ``n_words`` words drawn from ``pool``, the first ``common``
    repeated ``common_repeats`` times and the rest ``uncommon_repeats``, shuffled and written
    ``1. w 2. w ...``; returns the listing and the common words."""
    words = rng.sample(pool, n_words)
    items = words[:common] * common_repeats + words[common:] * uncommon_repeats
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), words[:common]


def ruler_cwe(target: int, seed: int, render: Render, count_tokens: CountTokens) -> Sample:
    """RULER's common-words extraction as RULER writes it (the task the 4K regression of
    issue 40 showed on): one solved example (40 words, 10 of them 10x among 3x), then the
    list (10 words 30x among words 3x, as many as fit) and the question (below 4096 tokens
    RULER's smaller repeats: 20 words 3x / 1x, then 6x / 1x), the answer prefix
    after the chat template's assistant turn; scored as RULER does (each of the 10 common
    words found in the answer)."""
    rng = _rng("ruler_cwe", seed)
    pool = list(_word_pool())
    # RULER's repeats: below 4096 tokens a 20-word example (3x / 1x) and a list of 6x / 1x
    short = target < 4096
    example, example_answer = _cwe_list(rng, pool, 20, 3, 1) if short else \
        _cwe_list(rng, pool, 40, 10, 3)
    repeats = (6, 1) if short else (30, 3)
    shot = RULER_CWE.format(context=example) + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(example_answer))
    state = rng.getstate()

    def build(n: int) -> tuple[str, list[str]]:
        rng.setstate(state)
        listing, common = _cwe_list(rng, pool, min(len(pool), 10 + n), *repeats)
        return render(shot + "\n" + RULER_CWE.format(context=listing)) + RULER_CWE_PREFIX, \
            common

    n, prompt = fit(lambda n: build(n)[0], count_tokens, target, hi=len(pool) - 10)
    common = build(n)[1]
    return Sample("ruler_cwe", seed, target, prompt, count_tokens(prompt),
                  "What are the 10 most common words in the above list?", tuple(common),
                  max_tokens=120, meta={"uncommon_words": n})


def _town(rng: random.Random) -> str:
    syllables = ("bran", "kel", "mor", "vish", "tal", "quin", "dor", "sel", "ath", "rum")
    return "".join(rng.choice(syllables) for _ in range(3)).capitalize()


def passage_qa(target: int, seed: int, render: Render, count_tokens: CountTokens) -> Sample:
    """Question over a passage: a synthetic fact paragraph about an observatory (founding year,
    founder, town, emblem) at depth ``DEPTHS[seed]``; one of its facts is asked."""
    rng = _rng("passage_qa", seed)
    depth = DEPTHS[seed % len(DEPTHS)]
    name = _town(rng)
    facts = {"year": str(rng.randrange(1700, 1950)),
             "founder": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
             "town": _town(rng),
             "emblem": rng.choice(ANIMALS)}
    color = rng.choice(COLORS)
    passage = (f"The {name} Observatory was founded in {facts['year']} by {facts['founder']} "
               f"in the town of {facts['town']}. Its great telescope was ground by hand over "
               f"eleven winters, and its emblem is a {color} {facts['emblem']} holding a star.")
    asked = rng.choice(sorted(facts))
    questions = {"year": f"In which year was the {name} Observatory founded?",
                 "founder": f"Who founded the {name} Observatory?",
                 "town": f"In which town was the {name} Observatory founded?",
                 "emblem": f"Which animal is on the emblem of the {name} Observatory?"}
    question = f"{questions[asked]} Answer briefly, using the document."
    prompt, n = _haystack_prompt(rng, [(depth, passage)], question, target, render,
                                 count_tokens)
    return Sample("passage_qa", seed, target, prompt, n, question, (facts[asked],),
                  depths=(depth,), max_tokens=24, meta={"asked": asked, "passage": passage})

def _near_misses(rng: random.Random, value: str, n: int) -> list[str]:
    """``n`` distinct numbers of ``value``'s length that differ from it in two digits (the
    leading digit never 0): what a blend of neighbouring values would write."""
    out: list[str] = []
    while len(out) < n:
        digits = list(value)
        for i in rng.sample(range(len(digits)), 2):
            choices = [c for c in "0123456789" if c != digits[i] and (i or c != "0")]
            digits[i] = rng.choice(choices)
        v = "".join(digits)
        if v != value and v not in out:
            out.append(v)
    return out


def long_number(target: int, seed: int, render: Render, count_tokens: CountTokens
                ) -> Sample:
    """Copying a long number: the asked needle's value has 7 to 10 digits (``7 + seed % 4``),
    at ``DEPTHS[seed]``; three needles with other keys hold near misses of it (two digits
    changed), so an answer blending nearby values writes a wrong or a forbidden number."""
    rng = _rng("long_number", seed)
    depth = DEPTHS[seed % len(DEPTHS)]
    keys = _keys(rng, 4)
    value = _number(rng, 7 + seed % 4)
    values = [value, *_near_misses(rng, value, 3)]
    depths = [depth] + [rng.uniform(0.05, 0.95) for _ in range(3)]
    question = (f"What is the special magic number for {keys[0]} mentioned in the document? "
                "Answer with the number only.")
    inserts = [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values, strict=True)]
    prompt, n = _haystack_prompt(rng, inserts, question, target, render, count_tokens)
    return Sample("long_number", seed, target, prompt, n, question, (value,),
                  forbidden=tuple(values[1:]), depths=tuple(depths), max_tokens=20,
                  meta={"keys": keys, "digits": len(value)})


Generator = Callable[[int, int, Render, CountTokens], Sample]
TASKS: dict[str, Generator] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "ruler_cwe": ruler_cwe,
    "passage_qa": passage_qa,
    "long_number": long_number,
}


def generate(task: str, target_tokens: int, seed: int, render: Render,
             count_tokens: CountTokens) -> Sample:
    """One sample of ``task`` (a key of :data:`TASKS`) sized to ``target_tokens`` tokens."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return TASKS[task](target_tokens, seed, render, count_tokens)
