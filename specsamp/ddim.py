"""diffusers' DDIMScheduler with eta > 0 as a kernel (being written)."""
