"""The `surgery` command line: parse, call the library, render."""
