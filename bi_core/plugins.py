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


def _check_allowlist(allow: set[str] | None, installed: set[str]) -> None:
    """``BI_PLUGINS`` naming a plugin that is not installed is a typo or a missing package, never a
    silent 'load nothing' (a built-in's name is a no-op: built-ins always load)."""
    missing = sorted((allow or set()) - installed - set(BUILTIN_PLUGINS))
    if missing:
        names = ", ".join(repr(n) for n in missing)
        raise PluginError(f"BI_PLUGINS: no installed plugin named {names}; installed (entry points of group "
                          f"{ENTRY_POINT_GROUP}): {', '.join(sorted(installed)) or 'none'}")


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
        entry_points = md.entry_points(group=ENTRY_POINT_GROUP)
        _check_allowlist(allow, {ep.name for ep in entry_points})
        for ep in entry_points:
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
        name = getattr(plugin, "__name__", None) or type(plugin).__qualname__  # errors name the plugin by it
        if pm.get_plugin(name) is not None:
            name = f"{name}-{i}"
        pm.register(plugin, name=name)
        infos.append(PluginInfo(name, "(in process)", "-", is_builtin=False))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        name = pm.get_name(e.plugin) or e.plugin
        raise PluginError(f"plugin '{name}' implements a hook that does not exist: {e}") from None
    return pm, infos


def load_registry(extra_plugins: tuple[object, ...] = (), load_entry_points: bool = True) -> Registry:
    """Call every plugin's register hooks and collect what they register."""
    pm, infos = make_plugin_manager(extra_plugins, load_entry_points)
    registry = Registry(plugins=infos)
    for impl in pm.hook.bi_register_backends.get_hookimpls():
        _call_hook(registry, "bi_register_backends", impl,
                   lambda b, owner=impl.plugin_name: registry.add_backend(b, owner))
    for impl in pm.hook.bi_register_strategies.get_hookimpls():
        _call_hook(registry, "bi_register_strategies", impl,
                   lambda s, owner=impl.plugin_name: registry.add_strategy(s, owner))
    return registry


def plugin_label(registry: Registry, name: str) -> str:
    """How errors name a plugin: its registered name (an entry point's name) and where it comes from."""
    info = next((p for p in registry.plugins if p.name == name), None)
    if info is None:
        return f"plugin '{name}'"
    if info.is_builtin:
        return f"built-in plugin '{name}'"
    if info.distribution == "(in process)":
        return f"plugin '{name}' (registered in process)"
    return f"plugin '{name}' (package {info.distribution} {info.version})"


def _call_hook(registry: Registry, hook: str, impl: pluggy.HookImpl, register) -> None:
    """One plugin's register hook; what it raises becomes one error naming the plugin and the hook."""
    try:
        impl.function(register=register)
    except PluginError as e:  # ours (a duplicate name, a builder for an unknown op): it says what, we say who
        raise PluginError(f"{plugin_label(registry, impl.plugin_name)}, hook {hook}: {e}") from e
    except Exception as e:  # noqa: BLE001 (whatever third-party code raises is the plugin's)
        if impl.plugin_name in BUILTIN_PLUGINS:  # our bug: its traceback is what helps
            raise
        raise PluginError(f"{plugin_label(registry, impl.plugin_name)} raised in hook {hook}: "
                          f"{type(e).__name__}: {e}") from e
