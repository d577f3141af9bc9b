"""k-diffusion's DPM-Solver++ SDE samplers (2M and 3M) as kernels with history (being written)."""
