"""A claim of the paper as data: what it says, what the paper reported, the rule that decides it, and the verdict.

A :class:`Rule` pairs a decision function with its text; both come from one factory call with the same parameters
(``interval_above("Δ loss", "delta", 0.0)``), so the rule a report prints is the rule the code applies. A
:class:`Claim` binds a statement and the paper's value to a rule, the numbers the rule reads, and its
preconditions (:class:`Check`: a named requirement with its measured value, e.g. "at least 2 seeds: 1"). Verdicts:

- ``"not testable at this scale"`` when a precondition fails (the rule is not applied);
- otherwise what the rule returns: ``"reproduced"``, ``"not reproduced"`` or ``"inconclusive"`` (also when a
  number the rule needs is missing).

Interval numbers are dicts with ``mean``, ``lo`` and ``hi`` (None where undefined), as ``report_kit.stats`` makes.
``Claim.to_dict()`` is the form written to summary.json and read by the combined report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable at this scale"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_TESTABLE)


@dataclass(frozen=True)
class Check:
    """A precondition of a claim: ``name`` (what is required), the measured ``value`` and whether it holds."""

    name: str
    value: Any
    ok: bool

    def text(self) -> str:
        return f"{self.name} (measured: {self.value}{'' if self.ok else '; fails'})"


def at_least(what: str, value, minimum) -> Check:
    """The precondition "at least ``minimum`` ``what``" with its measured ``value`` (None fails)."""
    return Check(f"at least {minimum} {what}", value, value is not None and value >= minimum)


@dataclass(frozen=True)
class Rule:
    """A decision rule: ``decide(numbers) -> verdict`` and the ``text`` that states it."""

    text: str
    decide: Callable[[Mapping[str, Any]], str]


def _bounds(numbers: Mapping, key: str):
    s = numbers.get(key) or {}
    return s.get("lo"), s.get("hi")


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def interval_above(label: str, key: str, threshold: float = 0.0) -> Rule:
    """Reproduced if the interval ``numbers[key]`` lies above ``threshold``, not reproduced if below, otherwise
    inconclusive."""

    def decide(numbers):
        lo, hi = _bounds(numbers, key)
        if lo is not None and lo > threshold:
            return REPRODUCED
        if hi is not None and hi < threshold:
            return NOT_REPRODUCED
        return INCONCLUSIVE

    t = _num(threshold)
    return Rule(f"Reproduced if the 95% CI of {label} lies above {t} (lower bound > {t}); not reproduced if it lies "
                f"below {t} (upper bound < {t}); otherwise inconclusive.", decide)


def interval_contains(label: str, key: str, value: float = 0.0) -> Rule:
    """Reproduced if the interval ``numbers[key]`` contains ``value``, not reproduced if it excludes it."""

    def decide(numbers):
        lo, hi = _bounds(numbers, key)
        if lo is None or hi is None:
            return INCONCLUSIVE
        return REPRODUCED if lo <= value <= hi else NOT_REPRODUCED

    v = _num(value)
    return Rule(f"Reproduced if the 95% CI of {label} contains {v}; not reproduced if it excludes {v}.", decide)


def every(*rules: Rule) -> Rule:
    """All parts must hold: reproduced if every rule says reproduced, not reproduced if any says not reproduced,
    otherwise inconclusive."""

    def decide(numbers):
        verdicts = [r.decide(numbers) for r in rules]
        if NOT_REPRODUCED in verdicts:
            return NOT_REPRODUCED
        return REPRODUCED if all(v == REPRODUCED for v in verdicts) else INCONCLUSIVE

    parts = " ".join(f"({i}) {r.text}" for i, r in enumerate(rules, 1))
    return Rule(f"{parts} The claim is reproduced if every part is, not reproduced if any part is not, otherwise "
                "inconclusive.", decide)


@dataclass(frozen=True)
class Claim:
    """One claim of the paper and its test on one run.

    ``statement``: the claim in words; ``paper``: the paper's reported value (or "no number given"); ``rule``: the
    decision rule; ``numbers``: the values the rule reads (JSON-serialisable); ``measured``: those values as text;
    ``preconditions``: checks that must hold for the test to mean anything at this scale; ``context``: an optional
    qualifier shown with the claim (e.g. the task)."""

    id: str
    statement: str
    paper: str
    rule: Rule
    numbers: Mapping[str, Any] = field(default_factory=dict)
    measured: str = ""
    preconditions: tuple[Check, ...] = ()
    context: str = ""

    @property
    def verdict(self) -> str:
        if any(not c.ok for c in self.preconditions):
            return NOT_TESTABLE
        return self.rule.decide(self.numbers)

    def to_dict(self) -> dict:
        """The claim as written to summary.json (``claim`` = the statement)."""
        return {"id": self.id, "claim": self.statement, "context": self.context, "paper": self.paper,
                "measured": self.measured, "rule": self.rule.text, "verdict": self.verdict,
                "preconditions": [{"name": c.name, "value": c.value, "ok": c.ok} for c in self.preconditions],
                "numbers": dict(self.numbers)}
