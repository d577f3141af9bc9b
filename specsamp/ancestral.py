"""ComfyUI's Euler ancestral for flow models and LCM as kernels (being written)."""
