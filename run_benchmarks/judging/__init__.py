"""Judging and recording: from a run's metric records to its figures, verdicts and files.

Owns the figures (metrics), the loss gate and the reference curves, the typed results,
results.json/results.md, verify, compare and the committed runs table. Imports planning only.
"""
