"""loops."""
