"""Accuracy CI: serve a catalog entry, run lm-eval against it, gate the results.

Run the Python tools as modules from the repository root, e.g.
`python -m scripts.ci.gate --help`; docs/accuracy.md describes the whole flow.
"""
