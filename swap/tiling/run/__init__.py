"""Tiled execution's running half: the tiled autograd engine, spatial segments, the tiled model,
and the language-model head and loss tiled along tokens."""
