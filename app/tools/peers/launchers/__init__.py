"""Scripts run by a peer's own Python (its virtual environment), not imported by SpecWhisper."""
