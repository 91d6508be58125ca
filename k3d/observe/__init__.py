"""What the daemon tells people: status, counters, latency, prediction quality,
Prometheus metrics and the route trace."""
