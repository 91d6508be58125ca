"""Shared memory: the sealed slot arena clients map read-only, and its huge pages."""
