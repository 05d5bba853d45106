"""The model wing: GPT-2 with myopic attention and position groups, its hooks, sites, loss and conversions.

Imports only the ground module ``ntpflow.files`` (and nothing above it).
"""
