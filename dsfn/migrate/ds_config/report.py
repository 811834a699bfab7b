"""The keys a ds_config section does not reproduce (one ConfigError) or only tunes (one warning)."""
from __future__ import annotations

import warnings

from dsfn.errors import ConfigError


class KeyReport:
    """Collects unsupported keys (one ConfigError) and ignored ones (one warning), each with why."""

    def __init__(self) -> None:
        self.unsupported: list[tuple[str, str]] = []
        self.ignored: list[tuple[str, str]] = []

    def refuse(self, key: str, why: str) -> None:
        """`key` is a setting dsfn does not reproduce (listed in the ConfigError)."""
        self.unsupported.append((key, why))

    def ignore(self, key: str, why: str) -> None:
        """`key` only tunes performance or logging (named in the warning)."""
        self.ignored.append((key, why))

    def raise_or_warn(self, stacklevel: int) -> None:
        """Raise one ConfigError listing every unsupported key, else warn once naming every
        ignored one (`stacklevel` as `warnings.warn` counts it from here)."""
        if self.unsupported:
            lines = "\n".join(f"  - {k}: {why}" for k, why in self.unsupported)
            raise ConfigError(f"ds_config has {len(self.unsupported)} setting(s) dsfn does not reproduce; remove "
                              f"them (or change them as noted) and call from_ds_config again:\n{lines}")
        if self.ignored:
            warnings.warn("ds_config keys that only tune performance or logging are ignored by dsfn: "
                          + ", ".join(f"{k} ({why})" for k, why in self.ignored), UserWarning, stacklevel=stacklevel)
