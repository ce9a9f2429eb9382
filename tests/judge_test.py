"""Tests for the judge's text parsing."""

import pytest

from rla_jax import judge


@pytest.mark.parametrize('text, expected', [
    ('no box here', None),
    (r'\boxed{1}', '1'),
    (r'first \boxed{a} then \boxed{b} end', 'b'),
    (r'\boxed{\frac{1}{2}}', r'\frac{1}{2}'),
    (r'\boxed{a{b{c}}d} tail', 'a{b{c}}d'),
    (r'\boxed{never closed', None),
    (r'\boxed{x} and \boxed{unclosed {', None),
    (r'\boxed{}', ''),
])
def test_last_boxed(text, expected):
  assert judge.last_boxed(text) == expected


@pytest.mark.parametrize('text, expected', [
    (r'The action is good. \boxed{1}', 1),
    (r'\boxed{+1}', 1),
    (r'\boxed{-1}', -1),
    (r'\boxed{ -1 }', -1),
    ('reasoning \\boxed{\u22121} done', -1),  # unicode minus
    ('\\boxed{\u20131}', -1),  # en dash
    ('\\boxed{\u20141}', -1),  # em dash
    ('\\boxed{\uff0b1}', 1),  # fullwidth plus
    (r'\boxed{1/2}', None),
    (r'\boxed{1 / 1}', None),
    (r'\boxed{\frac{1}{2}}', None),
    (r'\boxed{Score: -1}', -1),
    (r'\boxed{\text{-1}}', -1),
    (r'\boxed{$+1$}', 1),
    (r'\boxed{1.0}', 1),
    (r'\boxed{score 1 for step 3}', 1),
    (r'\boxed{1 or -1}', None),
    (r'\boxed{0}', None),
    (r'\boxed{2}', None),
    (r'\boxed{10}', None),
    (r'\boxed{good}', None),
    ('no box, the score is 1', None),
    (r'\boxed{-1} on second thought \boxed{1}', 1),
    (r'\boxed{1} on second thought \boxed{-1} because ...', -1),
    (r'\boxed{\boxed{-1}}', -1),
    # A spaced sign is a sign (it used to parse as +1).
    (r'\boxed{- 1}', -1),
    (r'\boxed{-\,1}', -1),
    ('\\boxed{\u2212  1}', -1),
    (r'\boxed{+ 1}', 1),
    (r'\boxed{- 1.0}', -1),
    (r'\boxed{-~1}', -1),
    (r'\boxed{Score: - 1}', -1),
    (r'\boxed{-\quad 1}', -1),
])
def test_parse_score(text, expected):
  assert judge.parse_score(text) == expected
