"""Pipeline-parallel training with micro-batches streamed through two stages."""
