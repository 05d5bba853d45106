"""A claim of the paper as data: what it says, what the paper reported, the rule that decides it, and the verdict.

A :class:`Rule` pairs a decision function with its text; both come from one factory call with the same parameters
(``interval_above("Δ loss", "delta", 0.0)``), so the rule a report prints is the rule the code applies. A
:class:`Claim` binds a statement and the paper's value to a rule, the numbers the rule reads, and its
preconditions (:class:`Check`: a named requirement with its measured value, e.g. "at least 2 seeds: 1"). Verdicts:

- ``"not testable at this scale"`` when a precondition fails (the rule is not applied);
- ``"ill-posed under Adam"`` (or under the run's optimizer) when every precondition holds but a *meaning* check of an
  influence claim fails: the split into components cancels (κ above its bound) or the optimizer's reading and the
  SGD direction disagree in sign (:func:`meaning_checks` in ``claim_registry``), so "which part built the feature"
  has no stable answer there; a meaning check that could not be measured makes the claim not testable instead;
- otherwise what the rule returns: ``"reproduced"``, ``"not reproduced"`` or ``"inconclusive"`` (also when a
  number the rule needs is missing).

Directional rules (:func:`interval_above`) need the interval, never only the mean, for either verdict. "Never"-type
claims ("a myopic model never learns ...", "not different from 0") use :func:`within_margin`, an equivalence test
against a margin stated with the rule: reproduced only if the 95% interval lies inside the margin, not reproduced
only if it lies outside it, otherwise inconclusive; so more noise can never make such a claim easier to reproduce.
Every rule and precondition records when it was ``fixed`` and ``against`` which data (what had been seen when it
was written); the reports print that record beside the rule. An influence claim also has a ``reading``: "exact
account" (decided on a replay whose residual is checked row by row) or "paper's reading" (the first-order sum
read on each step's batch; its verdict is printed marked as such).

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
UNMEASURED = "not measured"  # the value of a meaning check whose quantity the results do not hold
ILL_POSED = "ill-posed"  # the verdict's first word; the whole verdict names the optimizer ("ill-posed under Adam")
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_TESTABLE, ILL_POSED)


EXACT = "exact account"
PAPERS_READING = "paper's reading"


@dataclass(frozen=True)
class Check:
    """A precondition of a claim: ``name`` (what is required), the measured ``value`` and whether it holds; a
    threshold chosen by the project also records when it was ``fixed`` and ``against`` which data. ``short`` (the
    measured quantity in a few words, "legal acc") and ``need`` (its threshold, "≥ 0.97") are what the claims table
    prints of a failing check; the report's rules list prints the whole ``name``. ``ill_posed``: for a check of the
    split's meaning, the verdict its failure gives ("ill-posed under Adam") once every other check holds; a meaning
    check whose ``value`` is :data:`UNMEASURED` fails as any other check (not testable)."""

    name: str
    value: Any
    ok: bool
    fixed: str = ""
    against: str = ""
    short: str = ""
    need: str = ""
    ill_posed: str = ""

    def text(self) -> str:
        return f"{self.name} (measured: {self.value}{'' if self.ok else '; fails'})"


def at_least(what: str, value, minimum) -> Check:
    """The precondition "at least ``minimum`` ``what``" with its measured ``value`` (None fails)."""
    return Check(f"at least {minimum} {what}", value, value is not None and value >= minimum, short=what,
                 need=f"≥ {minimum}")


@dataclass(frozen=True)
class Rule:
    """A decision rule: ``decide(numbers) -> verdict``, the ``text`` that states it, and when it was ``fixed``
    (a date, with the commit where known) ``against`` which data (what had been seen then; "none" before any)."""

    text: str
    decide: Callable[[Mapping[str, Any]], str]
    fixed: str
    against: str

    def __post_init__(self):
        if not self.fixed or not self.against:
            raise ValueError(f"a rule records when it was fixed and against which data: {self.text[:60]!r}")

    def record(self) -> str:
        """"Fixed <date>, against <data>." as the reports print it."""
        return f"Fixed {self.fixed}, against {self.against}."


def _bounds(numbers: Mapping, key: str):
    s = numbers.get(key) or {}
    return s.get("lo"), s.get("hi")


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def interval_above(label: str, key: str, threshold: float = 0.0, *, fixed: str, against: str) -> Rule:
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
                f"below {t} (upper bound < {t}); otherwise inconclusive.", decide, fixed, against)


def within_margin(label: str, key: str, margin, *, lower=None, margin_text: str = "", why: str, fixed: str,
                  against: str) -> Rule:
    """An equivalence test (the interval-within-margin form of TOST at 2.5% a side): reproduced if the 95% interval
    ``numbers[key]`` lies inside [lower, margin] (``lower`` None: one-sided, the half-line up to ``margin``; for the
    two-sided "equal to 0" use ``lower = -margin``), not reproduced if it lies wholly outside (lo > margin or
    hi < lower), otherwise inconclusive (also with no interval). ``margin`` and ``lower`` are numbers, or keys of
    numbers in ``numbers`` when the margin is relative to a measured scale (``margin_text`` then says of what);
    ``why`` says why the margin is what it is."""

    def bound(numbers, m):
        return numbers.get(m) if isinstance(m, str) else m

    def decide(numbers):
        lo, hi = _bounds(numbers, key)
        top = bound(numbers, margin)
        bottom = None if lower is None else bound(numbers, lower)
        if lo is None or hi is None or top is None or (lower is not None and bottom is None):
            return INCONCLUSIVE
        if hi <= top and (bottom is None or lo >= bottom):
            return REPRODUCED
        if lo > top or (bottom is not None and hi < bottom):
            return NOT_REPRODUCED
        return INCONCLUSIVE

    m = margin_text or _num(margin)
    where = f"at most {m}" if lower is None else f"within ±{m}" if margin_text else f"inside [{_num(lower)}, {m}]"
    outside = f"lies above {m} (lower bound > {m})" if lower is None else "lies wholly outside that margin"
    return Rule(f"Equivalence test: reproduced if the whole 95% CI of {label} lies {where} (the margin: {why}); not "
                f"reproduced if it {outside}; otherwise inconclusive, so a wider interval cannot reproduce it.",
                decide, fixed, against)


def every(*rules: Rule, fixed: str | None = None, against: str | None = None) -> Rule:
    """All parts must hold: reproduced if every rule says reproduced, not reproduced if any says not reproduced,
    otherwise inconclusive."""

    def decide(numbers):
        verdicts = [r.decide(numbers) for r in rules]
        if NOT_REPRODUCED in verdicts:
            return NOT_REPRODUCED
        return REPRODUCED if all(v == REPRODUCED for v in verdicts) else INCONCLUSIVE

    parts = " ".join(f"({i}) {r.text}" for i, r in enumerate(rules, 1))
    return Rule(f"{parts} The claim is reproduced if every part is, not reproduced if any part is not, otherwise "
                "inconclusive.", decide, fixed or "; ".join(dict.fromkeys(r.fixed for r in rules)),
                against or "; ".join(dict.fromkeys(r.against for r in rules)))


@dataclass(frozen=True)
class Claim:
    """One claim of the paper and its test on one run.

    ``statement``: the claim in words; ``paper``: the paper's reported value (or "no number given"); ``rule``: the
    decision rule; ``numbers``: the values the rule reads (JSON-serialisable); ``measured``: those values as text;
    ``preconditions``: checks that must hold for the test to mean anything at this scale; ``context``: an optional
    qualifier shown with the claim (e.g. the task); ``reading``: for an influence claim, :data:`EXACT` or
    :data:`PAPERS_READING` (empty otherwise)."""

    id: str
    statement: str
    paper: str
    rule: Rule
    numbers: Mapping[str, Any] = field(default_factory=dict)
    measured: str = ""
    preconditions: tuple[Check, ...] = ()
    context: str = ""
    reading: str = ""

    @property
    def verdict(self) -> str:
        failing = [c for c in self.preconditions if not c.ok]
        if not failing:
            return self.rule.decide(self.numbers)
        measured = [c for c in failing if c.ill_posed and c.value != UNMEASURED]  # the split's meaning fails
        if measured and all(c.ill_posed for c in failing):  # every gate holds: the split, not the scale, fails
            return measured[0].ill_posed
        return NOT_TESTABLE

    def to_dict(self) -> dict:
        """The claim as written to summary.json (``claim`` = the statement)."""
        return {"id": self.id, "claim": self.statement, "context": self.context, "paper": self.paper,
                "measured": self.measured, "rule": self.rule.text, "verdict": self.verdict, "reading": self.reading,
                "fixed": self.rule.fixed, "against": self.rule.against,
                "preconditions": [{"name": c.name, "value": c.value, "ok": c.ok,
                                   **({"fixed": c.fixed, "against": c.against} if c.fixed else {}),
                                   **({"short": c.short, "need": c.need} if c.short else {}),
                                   **({"ill_posed": c.ill_posed} if c.ill_posed else {})}
                                  for c in self.preconditions],
                "numbers": dict(self.numbers)}


def verdict_text(claim: Mapping) -> str:
    """A claim's verdict as a report prints it (``claim``: ``Claim.to_dict()``): marked "(paper's reading)" when
    its influence was read the paper's way rather than by the exact account."""
    v = claim["verdict"]
    return f"{v} ({PAPERS_READING})" if claim.get("reading") == PAPERS_READING and v != NOT_TESTABLE else v
