"""Kernels on omlx's own hot path: moving KV between the cache tiers and the running batch.

Each kernel has a generic path built from MLX ops, which runs on every backend.
"""
