"""One module per paper artifact: its sweep (a Hydra experiment config), its table and its figures.

Figures are drawn from committed CSV tables only (``make figures``), never by sampling.
"""
