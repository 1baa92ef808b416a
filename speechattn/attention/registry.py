"""Name -> attention class registry (xformers-zoo style) and the `build` factory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from speechattn.attention.base import Attention, AttentionConfig
from speechattn.errors import ConfigError

_REGISTRY: dict[str, type[Attention]] = {}


def register(name: str) -> Callable[[type[Attention]], type[Attention]]:
    """Class decorator adding a variant under `name`; refuses duplicates and non-subclasses."""

    def decorator(cls: type[Attention]) -> type[Attention]:
        if name in _REGISTRY:
            raise ValueError(
                f"attention {name!r} is already registered ({_REGISTRY[name].__qualname__})"
            )
        if not (isinstance(cls, type) and issubclass(cls, Attention)):
            raise TypeError(f"{cls!r} registered as {name!r} is not a subclass of Attention")
        if not (isinstance(cls.Config, type) and issubclass(cls.Config, AttentionConfig)):
            raise TypeError(f"{cls.__qualname__}.Config must subclass AttentionConfig")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def available() -> list[str]:
    """Registered variant names, in registration order."""
    return list(_REGISTRY)


def get(name: str) -> type[Attention]:
    """The class registered under `name`; unknown names raise a ValueError listing valid ones."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown attention {name!r}; valid names: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def options(name: str) -> dict[str, Any]:
    """The variant's own options with their defaults (shared ones such as dropout excluded)."""
    base = {f.name for f in dataclasses.fields(AttentionConfig)}
    return {
        f.name: None if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(get(name).Config)
        if f.name not in base
    }


class UnknownOptionError(ConfigError, TypeError):
    """An option the variant does not have (`attention.options.strde=4`); a TypeError too."""


def build(name: str, dim: int, num_heads: int, **options: Any) -> Attention:
    """Variant `name` with D = `dim`, h = `num_heads` and its own options."""
    cls = get(name)
    allowed = [f.name for f in dataclasses.fields(cls.Config) if f.name not in ("dim", "num_heads")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UnknownOptionError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for attention {name!r}; "
            f"valid options: {', '.join(allowed)}"
        )
    return cls(cls.Config(dim=dim, num_heads=num_heads, **options))
