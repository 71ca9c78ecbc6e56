"""docs/guide/sdm_layer.md's complete recipe runs exactly as the page shows it and prints what the page
says it prints: its one Python block is executed as a script (a small CNN with an SDM head, k = 100,
`Center` and `normalize_output`, trained on 2,000 MNIST digits for 5 epochs), and its output is held
against the page's `text` block after it: the same lines, numbers within a small tolerance (float
rounding differs between machines), and no collapse warning."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "sdm_layer.md"
NUMBER = re.compile(r"[-+]?\d+\.?\d*")


def _blocks(text: str, language: str) -> list[str]:
  return re.findall(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)


def _numbers(line: str) -> list[str]:
  return NUMBER.findall(line)


def test_the_recipe_runs_as_shown_and_prints_what_the_page_says():
  text = PAGE.read_text()
  (code,) = _blocks(text, "python")  # one recipe on the page
  shown = _blocks(text[text.index(code) :], "text")[0].splitlines()
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, str(PAGE), "exec"), {"__name__": "__recipe__"})
  printed = out.getvalue().splitlines()
  assert len(printed) == len(shown), printed
  for got, want in zip(printed, shown):
    assert NUMBER.sub("#", got) == NUMBER.sub("#", want), (got, want)  # the same words
    for a, b in zip(_numbers(got), _numbers(want)):  # decimals within 0.05, whole numbers (%) within 2
      assert float(a) == pytest.approx(float(b), abs=0.05 if "." in b else 2), (got, want)
  assert printed[-1] == "collapse warning: None"
  accuracy = float(_numbers(printed[-3])[0])
  assert accuracy > 0.8  # 10 classes: chance is 0.1
