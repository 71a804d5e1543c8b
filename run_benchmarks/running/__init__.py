"""Running: a plan carried out round by round on this host, over SSH or under Slurm.

Owns the orchestrator, the runtimes, the remote layer (SSH, containers, host locks), the node
agent and the Slurm node wrapper, the monitors, progress and the causes of failures. Imports
planning and judging. The node agent's own modules import the standard library only.
"""
