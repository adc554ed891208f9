"""The reasoning parser: `<think>` blocks split off in any split of the stream, no partial tag in either
stream, a block opened by the prompt, no block at all, and the newline trimming Qwen3's template mirrors."""

from __future__ import annotations

import pytest

from asyncllm.parsing import ReasoningParser, ReasoningTags, prompt_opens_reasoning
from tests.parsing.streams import run_reasoning, splits

CASES = [  # (output, start_in_reasoning, reasoning, content)
    ("<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", False, "I add 2 and 2.", "It is 4."),
    ("\n <think>a\n\nb</think>c\n", False, "a\n\nb", "c\n"),
    ("It is 4, <think>no</think>.", False, "", "It is 4, <think>no</think>."),
    ("  It is 4.", False, "", "  It is 4."),
    ("I add.\n</think>\n\nIt is 4.", True, "I add.", "It is 4."),
    ("<think>\nI add.</think>It is 4.", True, "I add.", "It is 4."),  # a repeated opening tag is swallowed
    ("<think>\nstill going\n", False, "still going", ""),  # never closed: all reasoning
    ("<think>x</think>a</think>b<think>", False, "x", "a</think>b<think>"),
    ("<thi", False, "", "<thi"),
    ("<think>x</thin", False, "x</thin", ""),
    ("<think>思考 🤔 <\n</think>\n\n答え é", False, "思考 🤔 <", "答え é"),
    ("", False, "", ""),
    ("", True, "", ""),
]


@pytest.mark.parametrize(("output", "opened", "reasoning", "content"), CASES)
def test_every_split_gives_the_same_reasoning_and_content(
    output: str, opened: bool, reasoning: str, content: str
) -> None:
    for pieces in splits(output):
        got = run_reasoning(lambda: ReasoningParser(start_in_reasoning=opened), pieces)
        assert got == (reasoning, content), pieces


def test_a_tag_split_across_pieces_never_leaks() -> None:
    """Fed one character at a time, no delta ever holds part of a tag (here the only `<` and `>` are tags')."""
    parser = ReasoningParser()
    for ch in "<think>\nplan\n</think>\n\nanswer":
        reasoning, content = parser.feed(ch)
        assert not set("<>/") & set(reasoning + content), ch
    assert parser.finish() == ("", "")


def test_deltas_come_as_soon_as_they_are_decided() -> None:
    parser = ReasoningParser()
    assert parser.feed("<thi") == ("", "")
    assert parser.in_reasoning is False
    assert parser.feed("nk>\nstep one") == ("step one", "")
    assert parser.in_reasoning
    assert parser.feed("\n\n") == ("", "")  # held: they are dropped if the block ends right after them
    assert parser.feed("step two</") == ("\n\nstep two", "")
    assert parser.feed("think>\n\nIt") == ("", "It")
    assert parser.in_reasoning is False
    assert parser.feed(" is 4.") == ("", " is 4.")
    assert parser.finish() == ("", "")


def test_newlines_are_kept_when_not_trimming() -> None:
    text = "<think>\nR\n</think>\n\nA"
    for pieces in splits(text):
        assert run_reasoning(lambda: ReasoningParser(trim_newlines=False), pieces) == ("\nR\n", "\n\nA")


def test_custom_tags() -> None:
    tags = ReasoningTags("<|begin_of_thought|>", "<|end_of_thought|>")
    text = "<|begin_of_thought|>hmm<|end_of_thought|><think>x</think>"
    for pieces in splits(text, max_cuts=1):
        assert run_reasoning(lambda: ReasoningParser(tags), pieces) == ("hmm", "<think>x</think>")
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningTags("", "</think>")


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n", True),  # Qwen3-Thinking, DeepSeek-R1
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with thinking off
        ("<think>old</think> ... <|im_start|>assistant\n<think>\n", True),
    ],
)
def test_the_prompt_says_whether_the_output_starts_inside_reasoning(prompt: str, opened: bool) -> None:
    assert prompt_opens_reasoning(prompt) is opened
