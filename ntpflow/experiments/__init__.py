"""Reproductions of the paper's experiments.

``EXPERIMENTS`` maps an experiment name to (its module with the run function, that function's name, the module
with its ``write_report``). Every run function has the signature ``run(scale, out, **options)`` and is
resumable; every report reads only ``out``.
"""

EXPERIMENTS = {
    "toy": ("toy", "run_toy", "toy_report"),
    "othello": ("othello", "run_othello", "othello_report"),
    "stories": ("stories", "run_stories", "stories_report"),
    "llm": ("llm", "run_llm", "llm_report"),
}
