"""One module per pass; importing this package registers them all by name."""
from . import align, calibrate, replace, select  # noqa: F401
