"""Checkpoints: the format (checkpoint.py: safetensors shards and a manifest, saved so that a
killed save leaves the previous checkpoint whole), the manifest's checks (manifest.py: every field
is input), loading at any layout (reshard.py) and the --save folder's claim (save_folder.py)."""
