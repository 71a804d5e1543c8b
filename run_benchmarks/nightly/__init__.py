"""Nightly: a run list run round after round, kept in a history database, judged against it,
and written as a static report. Imports planning, judging and running.
"""
