"""Planning: from a case name, a vendor and a cluster to a frozen plan, before anything runs.

Owns case names, the config files and their validation, the registry of cases and vendors,
the plan (launch commands, environments, overrides, recipes), the check of the data read whole,
and which code a run runs. Imports nothing else of the harness (errors aside).
"""
