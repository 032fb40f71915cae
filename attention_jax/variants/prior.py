"""prior family (filled in by issue 4)."""
