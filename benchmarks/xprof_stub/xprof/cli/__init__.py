"""Stand-in: see xprof/__init__.py."""
