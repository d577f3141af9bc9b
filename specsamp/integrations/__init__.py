"""Entry points into the samplers people already run: diffusers schedulers and pipelines, k-diffusion's loop.

Each module imports its library only when called (diffusers is optional; k-diffusion is never imported: its
conventions are reproduced, not its code)."""
