"""Synthetic data sets made locally (no downloads), and sharding over ranks."""
