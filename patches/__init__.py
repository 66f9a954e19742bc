"""Small, documented runtime patches of verl 0.9.1, loaded through the verl.plugins entry point."""
