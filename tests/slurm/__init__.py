"""A real Slurm cluster for tests of the slurm backend (cluster.py, fixtures.py)."""
