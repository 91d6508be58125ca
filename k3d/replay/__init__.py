"""Offline analysis of route traces: the daemon's own policies (and OPT) replayed
over a trace, and how much several clients share."""
