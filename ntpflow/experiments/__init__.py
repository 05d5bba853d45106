"""Reproductions of the paper's experiments.

Every experiment has a run function ``run_<name>(scale, out, **options)`` (resumable) and a ``write_report(out)``
that reads only ``out``; ``report_all.EXPERIMENTS`` lists them.
"""
