"""The determinism harness: run every scenario on every TP x DP layout, record, diff bitwise (`python -m harness`)."""
