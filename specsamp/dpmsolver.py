"""diffusers' DPMSolverMultistepScheduler with algorithm_type="sde-dpmsolver++" as a kernel with history (being written)."""
