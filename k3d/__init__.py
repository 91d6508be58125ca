"""k3d: a shared expert-weight cache daemon for Mixture-of-Experts inference."""

__version__ = "0.1.0"
