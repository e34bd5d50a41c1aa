"""results."""
