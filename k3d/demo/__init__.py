"""demo: ``k3d demo`` (run, worker) and the synthetic checkpoint the demo, tests and benchmarks use"""
