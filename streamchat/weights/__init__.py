"""A model's weights read a tensor at a time from memory-mapped files, into the form they run in."""
