"""sparse family (filled in by issue 4)."""
