"""Impls shared by the CUDA backends (each backend's builders decide which it uses and what it
promises). Nothing here imports a GPU package at import time."""
