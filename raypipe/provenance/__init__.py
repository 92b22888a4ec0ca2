"""Provenance of an output's documents: input file and row, both ways (raypipe.provenance.rows)."""
