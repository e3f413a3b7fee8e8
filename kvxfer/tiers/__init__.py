"""Tiers: bounded byte stores of fixed-size slots, one block each."""
