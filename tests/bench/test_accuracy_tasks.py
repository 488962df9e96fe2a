"""Task generators and scorers of the accuracy harness (no model; a whitespace token proxy)."""

from __future__ import annotations

import re

import pytest

from bench.accuracy.prose import fit, insert_at_depths
from bench.accuracy.report import summarize, table
from bench.accuracy.scoring import contains, score
from bench.accuracy.tasks import DEPTHS, TASKS, generate


def _render(user: str) -> str:
    return f"<user>\n{user}\n<assistant>\n"


def _count(text: str) -> int:
    return len(text.split())


def _doc(prompt: str) -> str:
    """The haystack part of a rendered prompt (between the instruction and the question)."""
    body = prompt.split("Read the following document carefully.\n\n", 1)[1]
    return body.rsplit("\n\n", 1)[0]


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_and_seed_dependent(task):
    a = generate(task, 1500, 3, _render, _count)
    b = generate(task, 1500, 3, _render, _count)
    c = generate(task, 1500, 4, _render, _count)
    assert a == b
    assert a.prompt != c.prompt and a.expected != c.expected


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("target", [1000, 4096, 8192])
def test_prompt_length_near_target(task, target):
    s = generate(task, target, 0, _render, _count)
    assert s.prompt_tokens == _count(s.prompt)
    assert 0.97 * target <= s.prompt_tokens <= target


@pytest.mark.parametrize("task", list(TASKS))
def test_expected_values_are_in_the_prompt_and_unique_to_it(task):
    s = generate(task, 2000, 1, _render, _count)
    for value in s.expected + s.forbidden:
        assert contains(s.prompt, value), value
    assert set(s.expected).isdisjoint(s.forbidden)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("task", ["niah_single", "passage_qa"])
def test_needle_at_requested_depth(task, seed):
    s = generate(task, 4096, seed, _render, _count)
    assert s.depths == (DEPTHS[seed % len(DEPTHS)],)
    doc = _doc(s.prompt)
    needle = s.meta["passage"] if task == "passage_qa" else f"is: {s.expected[0]}."
    at = doc.index(needle)
    assert doc.count(needle) == 1
    assert abs(_count(doc[:at]) / _count(doc) - s.depths[0]) < 0.02


def test_multikey_needles_and_distractors():
    s = generate("niah_multikey", 4096, 2, _render, _count)
    doc = _doc(s.prompt)
    assert len(s.forbidden) == 3 and len(set(s.meta["keys"])) == 4
    for key in s.meta["keys"]:
        assert doc.count(f"special magic numbers for {key} is") == 1
    assert s.meta["keys"][0] in s.question


def test_multivalue_needles_share_one_key():
    s = generate("niah_multivalue", 4096, 0, _render, _count)
    key = re.search(r"numbers for (\S+) mentioned", s.question).group(1)
    assert all(f"for {key} is: {v}." in s.prompt for v in s.expected)
    assert len(set(s.expected)) == 4


def test_variable_chain_resolves_to_the_asked_value():
    s = generate("variable_tracking", 4096, 0, _render, _count)
    assign = dict(re.findall(r"^VAR (\w+) = (\w+)$", s.prompt, flags=re.MULTILINE))
    assert len(assign) == 10

    def resolve(var: str) -> str:
        while var in assign:
            var = assign[var]
        return var

    assert {v for v in assign if resolve(v) == s.meta["value"]} == set(s.expected)
    assert s.meta["value"] in s.question
    # The chain is in order of the document (each hop defined after the one it refers to).
    positions = [s.prompt.index(f"VAR {v} =") for v in s.expected]
    assert positions == sorted(positions)


def test_common_words_are_the_most_frequent():
    s = generate("common_words", 3000, 0, _render, _count)
    words = re.findall(r"^\d+\. (\w+)$", s.prompt, flags=re.MULTILINE)
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=lambda w: -counts[w])[:5]
    assert set(top) == set(s.expected)
    assert min(counts[w] for w in s.expected) > max(
        c for w, c in counts.items() if w not in s.expected)
    assert s.meta["rare_words"] > 100


@pytest.mark.parametrize("target,repeats", [(3000, (6, 1)), (4096, (30, 3))])
def test_ruler_cwe_is_rulers_common_words_extraction(target, repeats):
    """A solved example, then the list: its 10 common words each ``repeats[0]`` times, every
    other word ``repeats[1]``; the answer prefix closes the prompt."""
    s = generate("ruler_cwe", target, 2, _render, _count)
    assert s.prompt.endswith("<assistant>\n Answer: The top 10 words that appear most often "
                             "in the list are:")
    listing = s.prompt.split("What are the 10 most common words in the above list?")[1]
    assert re.search(r"list\? 1\. \w+ 2\. \w+ .* 10\. \w+\n", s.prompt)
    words = re.findall(r"\d+\. (\w+)", listing.split("Memorize the ones that appear most "
                                                  "often.\n")[1])
    counts = {w: words.count(w) for w in set(words)}
    assert len(s.expected) == 10 and {counts[w] for w in s.expected} == {repeats[0]}
    assert {c for w, c in counts.items() if w not in s.expected} == {repeats[1]}
    assert s.meta["uncommon_words"] > 50 and s.max_tokens == 120


def test_passage_question_asks_a_fact_of_the_passage():
    for seed in range(8):
        s = generate("passage_qa", 1000, seed, _render, _count)
        assert s.expected[0] in s.meta["passage"]
        assert s.meta["asked"] in ("year", "founder", "town", "emblem")


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task"):
        generate("nope", 1000, 0, _render, _count)


def test_insert_at_depths_and_fit():
    lines = [f"l{i}" for i in range(10)]
    text = insert_at_depths(lines, [(0.5, "MID"), (0.0, "TOP"), (1.0, "END")])
    assert text.split("\n") == ["", "TOP", "", *lines[:5], "", "MID", "", *lines[5:],
                                "", "END", ""]
    n, built = fit(lambda k: "w " * k, _count, 37, hi=100)
    assert n == 37 and _count(built) == 37


def test_contains_matches_whole_tokens_only():
    assert contains("The number is 1234567.", "1234567")
    assert not contains("12345678", "1234567")
    assert contains("Stag", "stag") and not contains("stagnant", "stag")
    assert contains("founded by Elena Marsh.", "Elena Marsh")


def test_score_on_hand_made_answers():
    assert score("The special magic number is 7391042.", ["7391042"]) == 1.0
    assert score("I don't know.", ["7391042"]) == 0.0
    assert score("1111111, 2222222 and 4444444", ["1111111", "2222222", "3333333",
                                                  "4444444"]) == 0.75
    assert score("ABCDE, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    # Naming a distractor's value voids a multi-key answer.
    assert score("7391042 or 5550001", ["7391042"], forbidden=["5550001"]) == 0.0
    with pytest.raises(ValueError):
        score("x", [])


def test_summary_and_table():
    runs = [{"config": "full", "samples": [{"task": "a", "seed": 0, "score": 1.0},
                                           {"task": "b", "seed": 0, "score": 0.5}]},
            {"config": "retro", "samples": [{"task": "a", "seed": 0, "score": 0.0},
                                            {"task": "b", "seed": 0, "score": 0.5}]}]
    s = summarize(runs, ["a", "b"])
    assert s["accuracy"] == {"a": {"full": 1.0, "retro": 0.0}, "b": {"full": 0.5, "retro": 0.5}}
    assert s["mean"] == {"full": 0.75, "retro": 0.25}
    assert s["delta_vs_full"] == {"full": 0.0, "retro": -0.5}
    assert s["missed_where_full_right"] == {"retro": ["a:0"]}  # b: full only half right
    text = table(s)
    assert "| a | 1.00 | 0.00 |" in text and "| delta vs full | +0.000 | -0.500 |" in text


def test_long_numbers_have_7_to_10_digits_and_near_miss_distractors():
    seen = set()
    for seed in range(8):
        s = generate("long_number", 3000, seed, _render, _count)
        value = s.expected[0]
        assert len(value) == 7 + seed % 4 == s.meta["digits"] and value[0] != "0"
        seen.add(len(value))
        assert len(set(s.forbidden)) == 3
        for miss in s.forbidden:  # the same length, two digits changed
            assert len(miss) == len(value) and miss[0] != "0"
            assert sum(a != b for a, b in zip(miss, value, strict=True)) == 2
        assert s.meta["keys"][0] in s.question
    assert seen == {7, 8, 9, 10}
