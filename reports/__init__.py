"""Drift reports between recorded runs, and the regroup study (`python -m reports`)."""
