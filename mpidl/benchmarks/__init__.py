"""Benchmarks importable by the CLI and by the thin runners under bench/.

``collectives``: mpidl's collectives against MPI's native calls (latency, bus bandwidth,
ratios), and the tuning run behind ``algorithm="auto"``.
"""
