"""The command lines: ``k3d`` (start, demo, replay, inspect, pack, install-unit) and ``k3ctl``."""
