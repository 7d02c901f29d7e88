"""Floor 7: measuring and advising (measure, profile, tune, doctor, bench)."""
