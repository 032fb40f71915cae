"""low_rank family (filled in by issue 4)."""
