"""Builds the plugin manager: built-in plugins, then entry points of group ``bi_engine.plugins``.

Environment: ``BI_PLUGINS=a,b`` loads only those entry points; ``BI_DISABLE_PLUGINS=a,b``
(or ``all``) skips them. Built-ins register through the very same hooks as third-party code.
Nothing here runs at import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os

import pluggy

import bi_core.hookspecs as hookspecs
from bi_core.errors import PluginError
from bi_core.registry import PluginInfo, Registry

ENTRY_POINT_GROUP = "bi_engine.plugins"
BUILTIN_PLUGINS = (
    "bi_core.backends.reference",
    "bi_core.backends.cuda_default",
    "bi_core.backends.cuda_hopper_invariant",
    "bi_core.backends.cuda_grouped_mm",
    "bi_core.strategies.ar",
    "bi_core.strategies.mtp",
)


def _env_names(var: str) -> set[str] | None:
    value = os.environ.get(var, "").strip()
    return None if not value else {n.strip() for n in value.split(",") if n.strip()}


def _version() -> str:
    try:
        return md.version("bi-engine")
    except md.PackageNotFoundError:
        return "source"


def make_plugin_manager(extra_plugins: tuple[object, ...] = (), load_entry_points: bool = True) -> tuple[
    pluggy.PluginManager, list[PluginInfo]
]:
    """A fresh plugin manager; ``extra_plugins`` are registered after the built-ins (tests use this)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    infos: list[PluginInfo] = []
    version = _version()
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
        infos.append(PluginInfo(module_name, "bi-engine", version, is_builtin=True))
    if load_entry_points:
        allow, deny = _env_names("BI_PLUGINS"), _env_names("BI_DISABLE_PLUGINS") or set()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            if "all" in deny or ep.name in deny or (allow is not None and ep.name not in allow):
                continue
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as e:  # a broken third-party package must not look like our bug
                raise PluginError(f"plugin '{ep.name}' ({ep.value}) failed to import: {e}") from e
            pm.register(plugin, name=ep.name)
            dist = ep.dist
            infos.append(PluginInfo(ep.name, dist.name if dist else "?", dist.version if dist else "?", False))
    for i, plugin in enumerate(extra_plugins):
        name = getattr(plugin, "__name__", None) or f"extra-{i}"
        pm.register(plugin, name=name)
        infos.append(PluginInfo(name, "(in process)", "-", is_builtin=False))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin '{e.plugin}' implements a hook that does not exist: {e}") from None
    return pm, infos


def load_registry(extra_plugins: tuple[object, ...] = (), load_entry_points: bool = True) -> Registry:
    """Call every plugin's register hooks and collect what they register."""
    pm, infos = make_plugin_manager(extra_plugins, load_entry_points)
    registry = Registry(plugins=infos)
    for impl in pm.hook.bi_register_backends.get_hookimpls():
        impl.function(register=lambda b, owner=impl.plugin_name: registry.add_backend(b, owner))
    for impl in pm.hook.bi_register_strategies.get_hookimpls():
        impl.function(register=lambda s, owner=impl.plugin_name: registry.add_strategy(s, owner))
    return registry
