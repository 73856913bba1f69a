"""Helpers shared by setup.py and the package: version and optional-library detection."""
