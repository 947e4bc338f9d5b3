"""Token generation: tokens through the sink cache, drawn, detokenized and reported as typed events."""
