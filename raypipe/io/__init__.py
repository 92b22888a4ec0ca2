"""Storage: URI -> filesystem, atomic commits, the typed manifest and unit records, metadata
serializers. Imports nothing of raypipe but errors."""
