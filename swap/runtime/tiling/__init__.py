"""Tiled execution's running half (seed 000): the tiled autograd engine, spatial segments, the tiled model,
and the language-model head and loss tiled along tokens."""
