"""Runnable examples that live in the package so Ray workers can import them."""
