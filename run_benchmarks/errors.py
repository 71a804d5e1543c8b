"""Errors of the host side.  ``InputError`` means bad input: exit status 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: a case name, a config file, a flag.

    The message is one line that names the file, field or host at fault.
    """


class RoundFailed(Exception):
    """A benchmark round did not complete; the message says why."""
