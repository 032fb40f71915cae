"""memory family (filled in by issue 4)."""
