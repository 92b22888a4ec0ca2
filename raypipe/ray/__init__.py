"""The only package that imports ray: the tokenize pipeline on Ray Data and session helpers."""
