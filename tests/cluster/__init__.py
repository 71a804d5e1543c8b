"""The real test cluster: network-namespace hosts with sshd and dockerd (see netns.py)."""
