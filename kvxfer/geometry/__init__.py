"""Geometry: layouts and addresses, the block checksum, block keys."""
