"""The engine wing: the exact three-way decomposition of the gradient at a site and the per-step influence on a
probed feature (forward-mode tangents, reverse-mode cotangents, the tracker, its run-axis batch). Tensors in, numbers
out: it reads no run folder. Imports only ``ntpflow.model``.
"""
