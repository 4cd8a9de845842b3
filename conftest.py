"""Repository-level pytest configuration: files that must not be imported for doctests."""

collect_ignore = ["src/evendp/__main__.py"]
