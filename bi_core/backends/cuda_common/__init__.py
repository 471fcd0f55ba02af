"""Impls shared by the CUDA backends (each backend's builders decide which it uses and what it
promises). Nothing here imports a GPU package at import time."""

from __future__ import annotations

from pathlib import Path

# Triton compiles recorded from the CUDA backends' starts, one file per start shape and GPU
# (bi_core/runtime/compile_manifest.py; shipped as package data)
COMPILE_MANIFESTS = Path(__file__).with_name("compile_manifests")
