"""What answers the HTTP face: the paged engine, the HF reference, and the token semantics they share."""
