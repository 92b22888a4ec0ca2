"""The only package that imports ray: the tokenize job on Ray actors, session helpers, the
Ray Train adapter and the Ray Data datasource."""
