"""The project's Hydra plugins: the `shared` launcher (shared_launcher.py)."""
