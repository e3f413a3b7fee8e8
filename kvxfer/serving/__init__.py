"""Serving: the pools a daemon serves, cache groups, per-pool policy (manager) and jobs."""
