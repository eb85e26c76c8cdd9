"""Tiled execution's deciding half: which operators tile, the segments, the tile counts from the
budget, the predicted peak and step time. Pure where it can be; ``analyze`` runs the model on the meta device."""
