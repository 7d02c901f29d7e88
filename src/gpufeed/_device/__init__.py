"""Floor 5: host-to-device copies ahead of the step, and GPU transforms."""
