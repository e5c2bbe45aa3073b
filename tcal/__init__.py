"""Taylor-Calibrate: the GDN layer, its kernels, and the math that initialises it from a teacher.

Usable without any graph: everything here takes tensors and modules."""
