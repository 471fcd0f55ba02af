"""Decoding strategies (registered through the plugin hooks like third-party ones)."""
