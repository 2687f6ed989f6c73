"""Experiments: commands built from the same pieces as ``train`` (diagnose, ablate, synthetic data)."""
