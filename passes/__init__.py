"""One module per pass; importing this package registers them all by name."""
